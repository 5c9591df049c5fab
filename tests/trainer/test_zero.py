"""ZeRO-1 (``--zero 1``) trains exactly what the same layout without it trains, with real MPI
ranks (mpiexec -n 2 and 4, `tests/support/zero_workers/worker.py`), and holds the bytes it
accounts for.

Tolerances (tests/support/numerics.py): the fp64 cases differ from zero 0 and from the
single-process
reference only by summation order (a reduce-scatter instead of an all-reduce, a gradient norm
summed over shards), so losses agree to the fp64 reduction bound and parameters to that bound
carried through Adam. In fp32 at dp 2 without clipping every gradient element is a sum of two
terms, which is exact in either order, and AdamW is elementwise, so zero 0 and zero 1 must be
bit-identical. Resuming at the same dp must be bit-identical too; at another dp the remaining
losses match the reference to the fp64 bound. Checkpoints hold each piece once: each DP rank
writes and reads back only its part of the optimizer state (`trainer.checkpoint.pieces`).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from tests.support.mpi_runs import world_run
from tests.support.numerics import f64, reduction_rtol
from tests.support.saved import same_states
from tests.support.serial_reference import bounds, train_serially
from tests.support.zero_workers.cases import CASES, RESUME_STEPS, STEPS, WORKER, case_config
from tests.support.zero_workers.worker import BIG, BIG_WORLD, BUDGET_BYTES
from trainer.checkpoint import rank_file
from trainer.config.options import make_config
from trainer.errors import TrainerError
from trainer.parallel.zero.layout import shard_layout
from trainer.parallel.zero.memory import PeakMemory, describe, expected_bytes
from trainer.placement import Placement, copies
from trainer.training.metrics import read_records

TOKENS = 8 * 32 + 32  # global batch x seq_len, + d_model: the longest sum in any element
RTOL = reduction_rtol(TOKENS)
LR = 3e-3
WORLD_CASES = [(w, name) for w, cases in CASES.items() for name, *_ in cases]


@functools.cache
def ranks(world: int) -> list[dict]:
    return world_run(WORKER, world).ranks


@functools.cache
def reference(world: int, name: str, steps: int = STEPS) -> dict:
    return train_serially(case_config(world, name, steps=steps), steps)


def losses_atol(ref: dict, steps: int = STEPS) -> float:
    return bounds(ref, steps=steps, lr=LR, n_terms=TOKENS).loss


# -- the shard layout (pure) -------------------------------------------------------------------

@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_every_gradient_element_is_owned_by_exactly_one_dp_rank(dp: int) -> None:
    numels = [7, 1, 300, 64, 5, 129, 2]
    owners = [torch.zeros(n, dtype=torch.int64) for n in numels]
    for rank in range(dp):
        layout = shard_layout(numels, 100, dp, rank, alone=[3])
        assert all((b.end - b.start) % dp == 0 for b in layout.buckets)
        for piece in layout.pieces():
            owners[piece.param][piece.lo:piece.hi] += 1
            lo, hi = layout.shard(piece.bucket)
            assert lo <= layout.offsets[piece.param] + piece.lo < hi
            assert piece.at + piece.hi - piece.lo <= hi - lo
    assert all(bool((o == 1).all()) for o in owners)


def test_a_parameter_never_straddles_buckets_and_a_lone_one_has_a_bucket_of_its_own() -> None:
    layout = shard_layout([10, 20, 30, 40, 50], 35, 4, 0, alone=[2])
    for b in layout.buckets:
        last = b.params[-1]
        assert layout.offsets[last] + layout.numels[last] <= b.end
    assert [list(b.params) for b in layout.buckets if 2 in b.params] == [[2]]


def test_a_lone_parameter_gets_the_same_elements_in_two_different_layouts() -> None:
    """The tied embedding of the first and the last pipeline stage: same numel, other
    neighbours; each DP rank must own the same elements of it on both stages."""
    for rank in range(3):
        first = shard_layout([50, 11, 7], 20, 3, rank, alone=[0])
        last = shard_layout([9, 33, 50], 20, 3, rank, alone=[2])
        mine = [(p.lo, p.hi) for p in first.pieces() if p.param == 0]
        assert mine == [(p.lo, p.hi) for p in last.pieces() if p.param == 2]


# -- memory (pure) ----------------------------------------------------------------------------

@pytest.mark.parametrize(("bf16", "zero", "dp", "per_param"), [
    (False, 0, 4, 16), (False, 1, 4, 8 + 8 / 4), (True, 0, 2, 18), (True, 1, 2, 6 + 12 / 2)])
def test_expected_bytes_follow_megatrons_bytes_per_parameter_table(
        bf16: bool, zero: int, dp: int, per_param: float) -> None:
    assert expected_bytes(1000, bf16=bf16, zero=zero, dp=dp).total == 1000 * per_param


def test_the_start_up_line_names_the_bytes_and_their_rule() -> None:
    line = describe(2**20, bf16=False, zero=1, dp=2, where="rank 0")
    assert "parameters 4.0 MiB + gradients 4.0 MiB + optimizer 4.0 MiB = 12.0 MiB" in line
    assert "8 + 8/2 bytes per parameter" in line


def test_peak_memory_covers_a_transient_tensor_and_starts_over_each_interval() -> None:
    peak = PeakMemory(torch.device("cpu"))
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, written, so resident
    del big
    with_big = peak.take()
    without = peak.take()
    assert with_big - without >= 60 * 2**20


def test_a_zero_stage_other_than_0_to_3_is_refused_naming_the_flag() -> None:
    with pytest.raises(TrainerError, match=r"--zero 4.*must be one of 0, 1, 2, 3"):
        make_config({"zero": 4}, {})


# -- equivalence (MPI) -------------------------------------------------------------------------

@pytest.mark.parametrize(("world", "name"), WORLD_CASES)
def test_zero1_losses_match_the_single_process_model(world: int, name: str) -> None:
    ref = reference(world, name)
    for rank in ranks(world):
        torch.testing.assert_close(f64(rank[name][1]["losses"]), f64(ref["losses"]),
                                   rtol=RTOL, atol=losses_atol(ref))


@pytest.mark.parametrize(("world", "name"), WORLD_CASES)
def test_zero1_parameters_match_the_same_layout_without_zero(world: int, name: str) -> None:
    ref = reference(world, name)  # the same model and data: its measured gradient scale
    atol = bounds(ref, steps=STEPS, lr=LR, n_terms=TOKENS).params
    for rank in ranks(world):
        plain, zero = rank[name][0], rank[name][1]
        torch.testing.assert_close(f64(zero["losses"]), f64(plain["losses"]), rtol=RTOL,
                                   atol=losses_atol(ref))
        assert zero["local"].keys() == plain["local"].keys()
        for key, want in plain["local"].items():
            torch.testing.assert_close(zero["local"][key], want, rtol=0, atol=atol,
                                       msg=f"rank {rank['rank']}: {key}")


@pytest.mark.parametrize("world", [2, 4])
def test_zero1_parameters_are_bit_identical_on_every_dp_rank(world: int) -> None:
    got = ranks(world)
    name = f"dp{world}"
    for rank in got[1:]:
        for key, want in got[0][name][1]["local"].items():
            assert torch.equal(rank[name][1]["local"][key], want), key


@pytest.mark.parametrize("name", [n + "-fp32" for n, *_ in CASES[2]] +
                         ["dp2-bf16", "dp2-bf16-wire"])
def test_zero1_at_dp2_is_bit_identical_to_zero0_checkpoint_included(name: str) -> None:
    """fp32, bf16 (fp32 main weights sharded) and fp32 reduced in bf16: the same losses,
    parameters and saved state, bit for bit: zero 1's pieces, put together, are zero 0's
    weights and moments."""
    rank = ranks(2)[0][name]
    assert rank[1]["losses"] == rank[0]["losses"]
    for key, want in rank[0]["local"].items():
        assert torch.equal(rank[1]["local"][key], want), key
    zero0, zero1 = rank[0]["saved"], rank[1]["saved"]
    assert same_states(zero0["state"], zero1["state"]) == []
    assert zero0["meta"]["optimizer"] == zero1["meta"]["optimizer"]


def test_each_zero1_rank_writes_its_own_pieces_one_dp_th_of_the_state() -> None:
    saved = [ranks(2)[0]["dp2-bf16"][1]["saved"],
             *ranks(4)[0]["change_dp"]["saved"].values()]
    for ckpt in saved:
        dp = ckpt["meta"]["layout"]["dp"]
        files = {f: size for f, size in ckpt["files"].items() if f.startswith("rank-")}
        assert sorted(files) == [rank_file(r) for r in range(dp)]
        assert max(files.values()) < 1.2 * sum(files.values()) / dp
        moments = [e for entries in ckpt["index"]["files"].values() for e in entries
                   if e["kind"] == "exp_avg"]
        assert all(e["flat"] is not None for e in moments)  # pieces, not whole tensors


@pytest.mark.parametrize(("world", "name"), WORLD_CASES)
def test_zero1_optimizer_state_is_one_dp_th_of_zero0s(world: int, name: str) -> None:
    dp = next(c[1] for c in CASES[world] if c[0] == name)
    for rank in ranks(world):
        whole, shard = rank[name][0]["held"].optimizer, rank[name][1]["held"].optimizer
        assert shard == pytest.approx(whole / dp, rel=0.1)


# -- resume ------------------------------------------------------------------------------------

def test_zero1_resume_at_the_same_dp_is_bit_exact() -> None:
    got = ranks(2)[0]["resume"]
    assert got["start"] == 2
    assert got["first"] + got["second"] == got["whole"]
    whole, split = got["states"]
    assert same_states(whole["state"], split["state"]) == []
    assert whole["meta"]["optimizer"]["step"] == split["meta"]["optimizer"]["step"] == \
        RESUME_STEPS


def test_a_resume_at_the_same_dp_reads_only_the_ranks_own_file() -> None:
    files = ranks(2)[0]["resume"]["states"][1]["files"]  # the checkpoint resumed
    for rank in ranks(2):
        reads = rank["resume"]["reads"]
        assert reads.files == (rank_file(rank["rank"]),)
        assert reads.bytes == files[reads.files[0]]


@pytest.mark.parametrize("change", ["2to4", "4to2"])
def test_a_resume_at_another_dp_opens_only_the_files_holding_its_pieces(change: str) -> None:
    """Which saved files a rank must read, from the saved pieces and this rank's own
    (`trainer.placement.copies`): exactly those the loader opened, never all of them."""
    saved = ranks(4)[0]["change_dp"]["saved"][change]
    entries = [(f, Placement.from_json(e)) for f, es in saved["index"]["files"].items()
               for e in es if e["kind"] == "param"]
    resumed = [r["change_dp"][change] for r in ranks(4) if change in r["change_dp"]]
    for new in resumed:
        holding = sorted({f for f, have in entries for want in new["placements"]
                          if want.name == have.name and copies(want, have)})
        assert new["reads"].files == tuple(holding)
        assert new["reads"].bytes == sum(saved["files"][f] for f in holding)
    old_dp = saved["meta"]["layout"]["dp"]
    assert all(len(new["reads"].files) < old_dp for new in resumed) or old_dp == 2


def test_resuming_a_zero1_checkpoint_with_another_model_is_refused_once_on_every_rank() -> None:
    got = [r["resume"]["refused"]["model"] for r in ranks(2)]
    assert all(g["agreed"] for g in got) and [g["report"] for g in got] == [True, False]
    assert got[0]["message"].startswith("checkpoint does not match this run [")
    assert "differing fields: n_layer: checkpoint 2, now 3" in got[0]["message"]
    assert got[0]["message"].endswith("Resume with the checkpoint's model, or use a new "
                                      "--run-dir")


def test_a_changed_byte_in_one_ranks_file_stops_every_rank_named_by_a_reader() -> None:
    got = [r["resume"]["refused"]["damaged"] for r in ranks(2)]
    assert all(g["agreed"] for g in got) and sum(g["report"] for g in got) == 1
    reporter = next(g for g in got if g["report"])
    assert f"[file {rank_file(1)}]: checksum mismatch" in reporter["message"]


def test_a_zero1_checkpoint_resumes_under_zero_0_reading_every_piece() -> None:
    files = ranks(2)[0]["resume"]["states"][1]["files"]
    for rank in ranks(2):  # a whole tensor's pieces lie in both ranks' files
        assert rank["resume"]["zero0"].files == (rank_file(0), rank_file(1))
        assert rank["resume"]["zero0"].step == RESUME_STEPS
    assert sum(files[rank_file(r)] for r in (0, 1)) > 0


def test_zero1_metrics_record_the_peak_memory_of_every_step() -> None:
    run_dir = ranks(2)[0]["resume"]["run_dirs"][0]
    records = read_records(Path(run_dir) / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, RESUME_STEPS + 1))
    assert all(r["peak_mem_bytes"] > 2**20 for r in records)


@pytest.mark.parametrize("change", ["2to4", "4to2"])
def test_zero1_resume_at_another_dp_continues_with_the_same_losses(change: str) -> None:
    ref = reference(4, "dp4", RESUME_STEPS)
    resumed = [r["change_dp"][change]["losses"] for r in ranks(4) if change in r["change_dp"]]
    assert resumed
    for losses in resumed:
        torch.testing.assert_close(f64(losses), f64(ref["losses"][2:]), rtol=RTOL,
                                   atol=losses_atol(ref, RESUME_STEPS))


# -- a model over budget -----------------------------------------------------------------------

@functools.cache
def big_ranks() -> list[dict]:
    return world_run("tests.support.zero_workers.worker:big", BIG_WORLD).ranks


def test_the_budget_model_would_not_fit_a_rank_whole() -> None:
    d, layers = BIG["d_model"], BIG["n_layer"]
    full = 12 * (layers * 12 * d * d + 256 * d)  # fp32 weights + Adam m, v, at least
    assert full > BUDGET_BYTES


def test_a_model_over_the_per_rank_budget_trains_with_tp_pp_and_zero_within_it() -> None:
    got = big_ranks()
    assert len(got) == BIG_WORLD == 2 * 2 * 2
    for rank in got:
        assert all(torch.isfinite(torch.tensor(rank["losses"]))), rank["losses"]
        assert len(rank["losses"]) == 2


@pytest.mark.parametrize("kind", ["params", "optimizer"])
def test_the_budget_models_measured_bytes_per_rank_match_the_accounting(kind: str) -> None:
    for rank in big_ranks():
        held = rank["held"]
        want = expected_bytes(rank["n_params"], bf16=False, zero=1, dp=2)
        assert held.params + held.optimizer < BUDGET_BYTES
        assert getattr(held, kind) == pytest.approx(getattr(want, kind), rel=0.1)
