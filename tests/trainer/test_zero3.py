"""ZeRO-3 foundations (``--zero 3``): parameters sharded in units (each block, the root),
gathered before forward and backward and freed after, trained with real MPI ranks at dp 4
(`tests/support/zero_workers/stage3.py`) and equal to the single-process model.

Tolerances (tests/support/numerics.py), as for ZeRO-1 and 2: in fp64 the run differs from the
single-
process model only by summation order (gradients reduce-scattered per microbatch, the norm
summed over shards); gathering moves values without arithmetic. So losses agree to the fp64
reduction bound over the longest sum and parameters to that bound carried through Adam.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
import torch

from tests.support import run_dtrain
from tests.support.moe_workers.cases import FORWARDS, plain_loop
from tests.support.mpi_runs import forked_python, world_run
from tests.support.numerics import f64, reduction_rtol
from tests.support.saved import same_states, saved_state, slice_of
from tests.support.serial_reference import Bounds, bounds, train_serially
from tests.support.zero_workers.stage3 import RESUME_STEPS, STAGE3_CASES, STEPS, stage3_config
from tests.support.zero_workers.stage3_moe import STEPS as MOE_STEPS
from tests.support.zero_workers.stage3_moe import zero3_moe_config
from tests.trainer.test_guard import DIVERGING
from trainer.config.options import make_config
from trainer.errors import ConfigError
from trainer.parallel.zero.layout import unit_layout
from trainer.parallel.zero.memory import describe, expected_bytes
from trainer.parallel.zero.unit_grads import unit_runs

WORKER = "tests.support.zero_workers.stage3:run"
TOKENS = 8 * 32 + 32  # global batch x seq_len, + d_model: the longest sum in any element
RTOL = reduction_rtol(TOKENS)
LR = 3e-3
NAMES = [name for name, *_ in STAGE3_CASES]


@functools.cache
def ranks() -> list[dict]:
    return world_run(WORKER, 4).ranks


@functools.cache
def reference(name: str) -> dict:
    return train_serially(stage3_config(name), STEPS)


def tolerances(name: str, steps: int = STEPS) -> Bounds:
    return bounds(reference(name), steps=steps, lr=LR, n_terms=TOKENS)


# -- units (pure) --------------------------------------------------------------------------

def test_each_block_is_one_unit_and_the_rest_forms_the_root_at_both_ends() -> None:
    names = ["ln_f.bias", "ln_f.weight", "blocks.1.mlp.fc.weight", "blocks.1.ln1.weight",
             "blocks.0.mlp.fc.weight", "blocks.0.ln1.weight", "tok_emb.weight"]
    assert unit_runs(names) == [range(0, 2), range(2, 4), range(4, 6), range(6, 7)]


def test_a_parameter_named_alone_is_a_unit_of_its_own() -> None:
    names = ["head.weight", "ln_f.weight", "blocks.3.ln1.weight"]
    assert unit_runs(names, alone=[0]) == [range(0, 1), range(1, 2), range(2, 3)]


def test_a_unit_is_one_bucket_padded_to_dp_and_each_rank_owns_a_block_of_it() -> None:
    layout = unit_layout([3, 4, 5, 6], [range(0, 2), range(2, 4)], dp=4, rank=1)
    assert [(b.start, b.end) for b in layout.buckets] == [(0, 8), (8, 20)]
    assert layout.offsets == (0, 3, 8, 13)
    assert [layout.shard(k) for k in (0, 1)] == [(2, 4), (11, 14)]


# -- bad input (pure) ----------------------------------------------------------------------

def test_zero3_with_compiled_blocks_is_refused_before_anything_is_built() -> None:
    with pytest.raises(ConfigError, match=r"unsupported combination \[--zero 3 with "
                                          r"--compile\]: .*hooks.*Drop --compile"):
        make_config({"zero": 3, "dp": 2, "compile": True}, {})


def test_zero3_runs_with_experts_but_refuses_them_with_hybrid_sharding() -> None:
    assert make_config({"zero": 3, "dp": 4, "ep": 2}, {"moe_experts": 4}).optimizer.zero == 3
    with pytest.raises(ConfigError, match=r"unsupported combination \[--moe-experts 4 with "
                                          r"--zero-shard-size 2\]: .*Drop --zero-shard-size 2"):
        make_config({"zero": 3, "dp": 4, "zero_shard_size": 2}, {"moe_experts": 4})


@pytest.mark.parametrize("options", [
    {"tp": 2, "dp": 2}, {"tp": 2, "dp": 2, "sequence_parallel": True, "recompute": "full"},
    {"recompute": "selective"}, {"precision": "bf16"}, {"precision": "auto"},
    {"pp": 2, "dp": 1, "schedule": "interleaved", "virtual_stages": 2, "microbatches": 4}])
def test_zero3_composes_with_tp_sp_pp_recomputation_and_bf16(options: dict) -> None:
    assert make_config({"zero": 3, "dp": 2, **options}, {}).optimizer.zero == 3


def test_a_shard_size_that_does_not_divide_dp_is_refused_before_anything_is_built() -> None:
    with pytest.raises(ConfigError, match=r"the ZeRO shard size does not divide the data-"
                                          r"parallel ranks \[--zero-shard-size 3, dp = 4\]: "
                                          r".*Choose a shard size that divides 4"):
        make_config({"zero": 3, "dp": 4, "zero_shard_size": 3}, {})


def test_hybrid_sharding_without_zero_is_refused_naming_both_flags() -> None:
    with pytest.raises(ConfigError, match=r"hybrid sharding needs ZeRO \[--zero-shard-size 2 "
                                          r"with --zero 0\]: .*Add --zero 1, 2 or 3"):
        make_config({"zero": 0, "dp": 4, "zero_shard_size": 2}, {})


def test_a_negative_prefetch_depth_is_refused_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"\[--zero-prefetch -1\]: must be >= 0"):
        make_config({"zero": 3, "precision": "fp32", "zero_prefetch": -1}, {})


# -- equivalence and memory (MPI, 4 ranks, fp64) --------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_zero3_losses_match_the_single_process_model_for_5_steps(name: str) -> None:
    ref, atol = reference(name), tolerances(name).loss
    for rank in ranks():
        torch.testing.assert_close(f64(rank[name]["losses"]), f64(ref["losses"]), rtol=RTOL,
                                   atol=atol)


@pytest.mark.parametrize("name", NAMES)
def test_zero3_parameters_gathered_at_the_end_match_the_single_process_model(name: str) -> None:
    """Each rank's parameters (its TP slice and pipeline stage) against the same slice of the
    single-process model's; the last stage's copy of a tied embedding against the embedding.
    Together the ranks hold every parameter."""
    ref = reference(name)
    seen = set()
    for rank in ranks():
        got = rank[name]
        for key, placement in got["placements"].items():
            whole = key if key in ref["params"] else "tok_emb.weight"  # the tied head's copy
            seen.add(whole)
            torch.testing.assert_close(got["local"][key].reshape(-1),
                                       slice_of(ref["params"][whole], placement), rtol=0,
                                       atol=tolerances(name).params,
                                       msg=f"rank {rank['rank']}: {key}")
    assert seen == set(ref["params"])


@pytest.mark.parametrize("name", NAMES)
def test_between_steps_a_rank_holds_one_dp_th_of_the_parameters_and_gradients(
        name: str) -> None:
    _, dp, _, over = next(c for c in STAGE3_CASES if c[0] == name)
    shard = over.get("zero_shard_size") or dp  # hybrid sharding: 1/shard, replicated beyond
    for rank in ranks():
        got = rank[name]
        whole = got["n_params"] * 8  # fp64, this rank's TP slice
        assert [now for now, _ in got["gathered"]] == [0] * STEPS  # no unit left gathered
        assert got["shard_bytes"] == pytest.approx(whole / shard, rel=0.02)
        assert got["grad_shard_bytes"] == got["shard_bytes"]


@pytest.mark.parametrize("name", NAMES)
def test_during_a_step_at_most_the_root_and_prefetch_plus_2_blocks_are_gathered(
        name: str) -> None:
    """The block computing, the ``prefetch`` posted after it, and one more while a gather
    lands (MPI's landing tensor, `trainer.parallel.zero.units`); never the whole model."""
    prefetch = stage3_config(name).optimizer.zero_prefetch
    for rank in ranks():
        got = rank[name]
        root = sum(got["unit_bytes"]) - sum(got["blocks"])
        bound = root + (prefetch + 2) * max(got["blocks"])
        assert all(0 < peak <= bound for _, peak in got["gathered"]), (got["gathered"], bound)
        assert bound < sum(got["unit_bytes"])


def test_zero3_in_bf16_is_bit_identical_to_zero1_on_fp32_main_weights() -> None:
    """dp 4, one microbatch, no clipping: the same arithmetic on the same numbers (the
    worker's `bf16_case`), so losses and the bf16 parameters agree bit for bit; ZeRO-1's bf16
    run is itself bit-identical to ZeRO-0's (tests/trainer/test_zero.py)."""
    for rank in ranks():
        one, three = rank["bf16"][1], rank["bf16"][3]
        assert three["main_dtypes"] == one["main_dtypes"] == ["torch.float32"]
        assert three["losses"] == one["losses"]
        assert three["local"].keys() == one["local"].keys()
        for key, want in one["local"].items():
            assert want.dtype == torch.bfloat16 or not want.is_floating_point(), key
            assert torch.equal(three["local"][key], want), key


# -- the NaN guard (the real launcher, 2 ranks) ----------------------------------------------

def test_zero3_skips_diverged_steps_leaving_the_sharded_parameters_untouched(
        tmp_path: Path) -> None:
    """dp 2 under --skip-nonfinite: a skipped step applies nothing to the parameter shards
    (no unit is left gathered half-way), so its checkpoint holds exactly the last applied
    step's pieces, and the run then stops."""
    done = run_dtrain(["launch", "--nproc-per-node", "2", "--", *forked_python(), "-m",
                       "trainer.train", *DIVERGING, "--dp", "2", "--zero", "3",
                       "--precision", "fp32", "--skip-nonfinite", "2",
                       "--run-dir", str(tmp_path)], timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-3000:]
    first, second = map(int, re.findall(r"\[0@localhost\] dtrain: step (\d+) skipped: the "
                                        r"loss is ", out))
    assert second == first + 1
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step-{first}", f"step-{second}"]
    before, after = (saved_state(ckpts / f"step-{s}") for s in (first, second))
    assert same_states(before, after) == []


# -- checkpoints (MPI, 4 ranks, fp64, through trainer.train) -----------------------------------

@pytest.mark.parametrize("change", ["3to1", "3to0", "1to3"])
def test_a_run_resumed_across_zero_3_continues_with_the_same_losses(change: str) -> None:
    """Each piece is saved once, at its placement (ZeRO-1's pieces): another stage reads the
    same tensors, so the steps after the resume differ only in summation order."""
    atol = tolerances("dp4", RESUME_STEPS).loss
    for rank in ranks():
        got = rank["resume"]
        assert got[change]["start"] == 2 and len(got["whole"]) == RESUME_STEPS
        torch.testing.assert_close(f64(got[change]["losses"]), f64(got["whole"]), rtol=RTOL,
                                   atol=atol)


def test_zero3_expected_bytes_shard_everything() -> None:
    table = expected_bytes(1000, bf16=False, zero=3, dp=4)
    assert (table.params, table.grads, table.optimizer) == (1000, 1000, 2000)
    assert "16/4 bytes per parameter" in describe(1000, bf16=False, zero=3, dp=4, where="")


def test_zero3_expected_bytes_shard_the_experts_over_edp_and_the_rest_over_dp() -> None:
    """600 dense parameters over dp 4, 400 experts' over edp 2 (dp 4 / ep 2)."""
    table = expected_bytes(1000, bf16=False, zero=3, dp=4, experts=400, experts_over=2)
    per = 600 / 4 + 400 / 2
    assert (table.params, table.grads, table.optimizer) == (4 * per, 4 * per, 8 * per)
    line = describe(1000, bf16=False, zero=3, dp=4, where="", experts=400, experts_over=2)
    assert "16/4; the 400 experts' 16/2 bytes per parameter" in line


# -- mixture of experts: dp 4 = ep 2 x edp 2 (MPI, 4 ranks, fp64) ----------------------------

MOE_WORKER = "tests.support.zero_workers.stage3_moe:run"
MOE_TOKENS = 8 * 16 + 4 * 16  # tokens of a step + the widest matmul (the experts' hidden)


@functools.cache
def moe_ranks() -> list[dict]:
    return world_run(MOE_WORKER, 4).ranks


@functools.cache
def moe_reference() -> dict:
    """The single-process model, every MoE layer computed by the plain loop, on the same 4
    forward passes per step (`tests.support.moe_workers.cases`)."""
    return train_serially(zero3_moe_config(None), MOE_STEPS, prepare=plain_loop(FORWARDS))


def test_zero3_with_experts_matches_the_single_process_model_for_5_steps() -> None:
    """Losses and every parameter (each expert on the ranks of its EP place) within the fp64
    bounds of the step's longest sum, as `tests/trainer/test_moe_training.py` derives them; a
    lost 1/ep, an expert reduced over dp instead of edp or a unit gathered from the wrong
    group moves the parameters by O(lr)."""
    ref = moe_reference()
    lr = zero3_moe_config().optimizer.lr
    rtol = reduction_rtol(MOE_TOKENS)
    tol = bounds(ref, steps=MOE_STEPS, lr=lr, n_terms=MOE_TOKENS)
    loss_tol, param_tol = tol.loss, tol.params
    seen = set()
    for rank in moe_ranks():
        torch.testing.assert_close(f64(rank["losses"]), f64(ref["losses"]), rtol=rtol,
                                   atol=loss_tol)
        for name, value in rank["params"].items():
            torch.testing.assert_close(value, ref["params"][name], rtol=0, atol=param_tol,
                                       msg=f"rank {rank['rank']}: {name}")
            seen.add(name)
    assert seen == set(ref["params"])  # every expert is held somewhere


def test_zero3_shards_the_dense_units_over_dp_and_the_experts_over_edp() -> None:
    """Two parts: the dense parameters in every block's unit over the 4 DP ranks, the experts
    in units of the MoE blocks (0 and 2) only, over the 2 ranks at the same EP place; the
    optimizer's pieces are no replicas over either, and nothing is gathered between steps."""
    for rank in moe_ranks():
        dense, experts = rank["parts"]
        assert (dense["group"], dense["blocks"]) == (4, ["0", "1", "2", "3"])
        assert (experts["group"], experts["blocks"]) == (2, ["0", "2"])
        for part in (dense, experts):
            assert part["shard_elements"] == pytest.approx(part["params"] / part["group"],
                                                           rel=0.01)
        experts_here = [n for n in rank["params"] if ".experts." in n]
        assert len(experts_here) == 2 * 2 * 2  # 2 MoE layers x 2 of 4 experts x fc, proj
        assert {rank["replicated"][n] for n in experts_here} == {("cp", "zs", "zr", "tp")}
        assert {rank["replicated"][n] for n in rank["params"] if n not in experts_here} == {
            ("cp", "ep", "zs", "zr", "tp")}
        assert rank["pieces"] == {"('tp',)"}
        assert [now for now, _ in rank["gathered"]] == [0] * MOE_STEPS
        assert all(peak > 0 for _, peak in rank["gathered"])


KIB = 1024
LINE = re.compile(r"parameters ([\d.]+) KiB \+ gradients ([\d.]+) KiB \+ optimizer ([\d.]+) KiB = "
                  r"([\d.]+) KiB \((.*) bytes per parameter\)")
"""The start-up line of a model under a MiB per rank."""


def test_zero3_with_experts_holds_the_dense_part_over_dp_and_the_experts_over_edp() -> None:
    """Between steps a rank holds 1/dp of its dense parameters and 1/edp of its experts, as
    parameter, gradient (every group's shards) and AdamW state (2x) in fp64, as the
    ``--memory-budget`` meter measures it and as the trainer's start-up line says (fp32's
    4 bytes an element there); dividing the experts by dp would show them at half."""
    for rank in moe_ranks():
        experts = rank["n_experts"]
        dense = rank["n_params"] - experts
        assert dense and experts
        per = dense / 4 + experts / 2  # elements: dense/dp + experts/edp
        held = rank["held"]
        assert held["params"] == pytest.approx(8 * per, rel=0.02)
        assert held["grads"] == pytest.approx(8 * per, rel=0.02)  # both groups' shards
        assert held["optimizer"] == pytest.approx(16 * per, rel=0.02)
        assert rank["measured"] - rank["staged_peak"] == sum(held.values())
        got = LINE.search(rank["line"])
        assert got, rank["line"]
        assert got[5] == f"16/4; the {experts:,} experts' 16/2"
        for shown, bytes_per in zip(got.groups()[:4], (4, 4, 8, 16), strict=True):
            assert float(shown) == pytest.approx(bytes_per * per / KIB, abs=0.05)
