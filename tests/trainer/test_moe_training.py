"""Expert-parallel training equals the serial plain-loop MoE: ep 1, 2, 4, ep 2 x tp 2, ep 2 x pp 2.

One 4-rank run of `tests.support.moe_workers.worker` trains both cases (dropless; sigmoid router
with a
capacity that drops tokens) at every layout through the trainer's own ``build_run``/``train_step``
in fp64; the reference is one process computing every MoE layer token by token
(`tests.support.moe_reference`) on the same forward passes. Only summation orders differ, so the
tolerances are the fp64 bounds of tests/support/numerics.py; a lost token, a wrong split, a
missing 1/ep
or a gradient reduced over the wrong group moves parameters by O(lr) = 3e-3. The same run
probes the all-to-all round trip and a forced imbalance (every token to one expert).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.moe_workers.cases import (
    CASES,
    LAYOUTS,
    STEPS,
    WORKER,
    WORLD,
    case_config,
    serial_reference,
)
from tests.support.mpi_runs import world_run
from tests.support.numerics import assert_within_order, f64, reduction_rtol
from tests.support.serial_reference import Bounds, bounds
from trainer.parallel.tensor.sharding import shard_tensor

TOKENS = 8 * 16 + 4 * 16  # tokens of a step + the widest matmul (mlp hidden): longest sum
RTOL = reduction_rtol(TOKENS)
LR = case_config("dropless").optimizer.lr


def ranks() -> list[dict]:
    return world_run(WORKER, WORLD).ranks


def tolerances(case: str) -> Bounds:
    return bounds(serial_reference(case), steps=STEPS, lr=LR, n_terms=TOKENS)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", list(CASES))
def test_losses_equal_the_serial_plain_loop_moe(case: str, layout: str) -> None:
    want = f64(serial_reference(case)["losses"])
    for rank in ranks():
        got = f64(rank[f"{case}/{layout}"]["losses"])
        torch.testing.assert_close(got, want, rtol=RTOL, atol=tolerances(case).loss)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", list(CASES))
def test_every_parameter_shard_equals_the_serial_plain_loop_moe(case: str, layout: str) -> None:
    want = serial_reference(case)["params"]
    atol = tolerances(case).params
    seen = set()
    for rank in ranks():
        got = rank[f"{case}/{layout}"]
        tp = LAYOUTS[layout].get("tp", 1)
        for name, value in got["params"].items():
            # The last stage's copy of a tied head is the embedding's weight.
            full = want[name if name in want else "tok_emb.weight"]
            spec = got["specs"][name]
            expected = full if spec is None else shard_tensor(full, got["tp_rank"], tp, spec)
            torch.testing.assert_close(value, expected, rtol=0, atol=atol, msg=name)
            seen.add(name if name in want else "tok_emb.weight")
    assert seen == set(want)  # every expert is held somewhere


@pytest.mark.parametrize("case", list(CASES))
def test_the_first_gradient_norm_equals_the_serial_one(case: str) -> None:
    want, atol = serial_reference(case)["norms"][0], tolerances(case).norm
    for layout in LAYOUTS:
        for rank in ranks():
            assert abs(rank[f"{case}/{layout}"]["norms"][0] - want) <= RTOL * want + atol


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", list(CASES))
def test_the_step_records_count_every_routed_token_and_the_drops(case: str, layout: str) -> None:
    """Rank 0 logs, per step, the load of the global batch: 8 x 16 tokens x top-2 routed in
    layer 0 (the only MoE layer), drops only with a capacity, the auxiliary loss near its
    coefficient 1e-2 (plus a small z-loss)."""
    for load in ranks()[0][f"{case}/{layout}"]["moe"]:
        assert list(load) == ["blocks.0.mlp"]
        layer = load["blocks.0.mlp"]
        assert sum(layer["tokens"]) == 8 * 16 * 2 and len(layer["tokens"]) == 4
        assert (layer["dropped"] > 0) == (case == "dropping")
        assert 1e-2 <= layer["aux_loss"] < 5e-2


@pytest.mark.parametrize("routing", ["all_to_expert_0", "spread", "rank_0_sends_nothing"])
def test_combine_after_dispatch_over_ep_is_the_identity(routing: str) -> None:
    assert all(rank["round_trip"][routing] for rank in ranks())


def test_a_router_sending_every_token_to_one_expert_gives_the_serial_gradients() -> None:
    """To the rounding of each value's chain of sums times its magnitude measured on the
    probe's weights and tokens (`tests.support.moe_reference.magnitudes`): expert 0's gradient sums
    over every token of every rank."""
    for rank in ranks():
        probe = rank["imbalance"]
        mag, terms = probe["mag"], probe["terms"]
        for key in ("out", "grad", "router"):
            assert_within_order(probe[key], probe["ref_" + key], n_terms=terms,
                                magnitude=mag[key], name=key)
        for got, want, m in zip(probe["expert0"], probe["ref_expert0"], mag["expert0"],
                                strict=False):
            assert_within_order(got / probe["ep_scale"], want, n_terms=terms, magnitude=m,
                                name="expert 0")
    assert ranks()[0]["imbalance"]["expert0"]
