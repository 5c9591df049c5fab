"""Sequence parallelism and activation recomputation match the runs without them; per-rank
construction gives every rank its slice of the serial initialisation without the whole model.

One ``mpiexec`` run per world size (2 and 4) of `tests.support.activation_workers.worker` trains
every
run of `cases.RUNS` in fp64 through the trainer's own ``build_run``/``train_step``: sequence
parallelism at tp 2 and 4 (tied LayerNorm model; untied RMSNorm model with biases, whose norm
and row-parallel bias gradients must be summed over TP), selective and full recomputation at
tp 2 and in every pipeline schedule, and both together at tp 2 x pp 2. Each is compared, rank
by rank, with the same layout without the technique. Both sides run in fp64 and differ only in
the order of sums (reduce-scatter + all-gather instead of all-reduce, per-block norm gradients
summed over TP), so the tolerances are the fp64 bounds of tests/support/numerics.py; a forgotten
TP sum
or a wrong sequence block moves parameters by O(lr) = 3e-3. With dropout on (0.2), a recompute
that redrew other masks would compute gradients of another network: those runs must match too.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.support.activation_workers.cases import (
    BIG,
    BIG_SEED,
    CONSTRUCTION,
    GLOBAL_BATCH,
    GPT,
    RUNS,
    STEPS,
    TRAIN,
    WORKER,
    Run,
)
from tests.support.mpi_runs import world_run
from tests.support.numerics import f64, reduction_rtol
from tests.support.serial_reference import Bounds, bounds, train_serially
from trainer.config.options import parse_args
from trainer.construction.init_stream import PIECE
from trainer.errors import ConfigError
from trainer.model.gpt import GPT as SerialGPT
from trainer.parallel.tensor import shard_tensor

TOKENS = GLOBAL_BATCH * GPT["seq_len"] + 4 * GPT["d_model"]  # the longest sum in any element
RTOL = reduction_rtol(TOKENS)
COMPARED = [(world, run) for world, runs in RUNS.items() for run in runs if run.base]


@functools.cache
def tolerances(base: str) -> Bounds:
    """The bounds of the run ``base``, its gradient scale measured by the serial reference of
    the same model and data (with dropout: on masks of its own, the same rates)."""
    run = next(r for runs in RUNS.values() for r in runs if r.name == base)
    return bounds(train_serially(run.config("unused"), STEPS), steps=STEPS, lr=TRAIN["lr"],
                  n_terms=TOKENS)


@pytest.mark.parametrize(("world", "run"), COMPARED, ids=[r.name for _, r in COMPARED])
def test_the_technique_gives_the_losses_and_parameters_of_the_run_without_it(world: int,
                                                                             run: Run) -> None:
    for rank in world_run(WORKER, world).ranks:
        got, want, tol = rank[run.name], rank[run.base], tolerances(run.base)
        torch.testing.assert_close(f64(got["losses"]), f64(want["losses"]), rtol=RTOL,
                                   atol=tol.loss)
        assert got["params"].keys() == want["params"].keys()
        for name, value in want["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=0, atol=tol.params,
                                       msg=f"{run.name}: {name}")


def test_dropout_really_runs_in_the_recompute_comparisons() -> None:
    """Otherwise the mask-reproduction comparisons above would prove nothing."""
    ranks = world_run(WORKER, 2).ranks
    for plain, dropped in (("tp2", "tp2-drop"), ("pp2-1f1b", "pp2-drop")):
        gap = abs(ranks[0][plain]["losses"][0] - ranks[0][dropped]["losses"][0])
        assert gap > 1e-3, (plain, dropped)


# -- per-rank construction -------------------------------------------------------------------

BUILT = [(world, tp, pp) for world, layouts in CONSTRUCTION.items() for tp, pp in layouts]


@pytest.fixture(scope="module")
def serial_init() -> dict[str, torch.Tensor]:
    """The serial model's initial weights (fp32, as the workers built theirs)."""
    return {n: p.detach() for n, p in SerialGPT(BIG, seed=BIG_SEED).named_parameters()}


def _built(world: int, tp: int, pp: int) -> list[dict]:
    return [r["construction"][f"tp{tp}pp{pp}"] for r in world_run(WORKER, world).ranks]


@pytest.mark.parametrize(("world", "tp", "pp"), BUILT, ids=[f"tp{t}pp{p}" for _, t, p in BUILT])
def test_every_shard_equals_its_slice_of_the_serial_initialisation(
        world: int, tp: int, pp: int, serial_init: dict[str, torch.Tensor]) -> None:
    held = set()
    for built in _built(world, tp, pp):
        for name, value in built["params"].items():
            source = name if name in serial_init else "tok_emb.weight"  # last stage's tied copy
            spec = built["specs"][name]
            want = serial_init[source]
            if spec is not None:
                want = shard_tensor(want, built["tp_rank"], tp, spec)
            assert torch.equal(value, want), (built["tp_rank"], name)
            held.add(source)
    assert held == set(serial_init)  # the ranks together hold the whole model


@pytest.mark.parametrize(("world", "tp", "pp"), BUILT, ids=[f"tp{t}pp{p}" for _, t, p in BUILT])
def test_no_rank_allocates_a_whole_sharded_weight_or_the_whole_model_while_building(
        world: int, tp: int, pp: int, serial_init: dict[str, torch.Tensor]) -> None:
    largest_weight = max(p.numel() for p in serial_init.values())
    whole = sum(p.numel() for p in serial_init.values())
    longest_row = max(p[0].numel() for p in serial_init.values() if p.dim() > 1)
    for built in _built(world, tp, pp):
        kept = [p.numel() for p in built["params"].values()]
        # One drawn piece (plus a row being cut) or the largest shard the rank keeps: no more.
        assert built["largest_allocation"] <= max(max(kept), PIECE + longest_row)
        assert sum(kept) < whole
        if tp > 1:  # every large weight is sharded: none is ever allocated whole
            assert built["largest_allocation"] < largest_weight


# -- options ---------------------------------------------------------------------------------

def test_sequence_parallelism_without_tensor_parallelism_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError) as err:
        parse_args(["--sequence-parallel"])
    assert str(err.value).startswith(
        "sequence parallelism needs tensor parallelism [--sequence-parallel --tp 1]: ")
    assert "Add --tp 2 (or more), or drop --sequence-parallel" in str(err.value)


def test_a_sequence_that_does_not_split_over_tp_is_refused_naming_both_values() -> None:
    with pytest.raises(ConfigError) as err:
        parse_args(["--sequence-parallel", "--tp", "4", "--n-head", "4", "--seq-len", "18"])
    assert "[--sequence-parallel --tp 4 --seq-len 18]" in str(err.value)
    assert "seq_len 18 is not divisible by tp 4" in str(err.value)


def test_an_unknown_recompute_mode_is_refused_listing_the_modes() -> None:
    with pytest.raises(ConfigError) as err:
        parse_args(["--recompute", "some"])
    assert "[--recompute some]: must be one of none, selective, full" in str(err.value)


def test_the_training_entry_accepts_the_new_options() -> None:
    cfg = parse_args(["--tp", "2", "--sequence-parallel", "--recompute", "selective"])
    assert cfg.parallel.sequence_parallel and cfg.parallel.recompute == "selective"
