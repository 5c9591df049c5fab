"""Data parallelism equals the single-process model, with real MPI ranks (mpiexec -n 1, 2, 4).

The worker (`tests/support/dp_workers/equivalence.py`) trains every case of
`tests/support/dp_workers/cases.py`
with the trainer's own step function and saves what each rank saw; the single-process reference
is computed here, in the pytest process, with the plain model, plain ``loss.backward()`` on the
whole global batch and the same optimizer.

Tolerance: the cases run in fp64 on both sides, and DP only sums the same per-sequence gradients
in another order (per rank, then across ranks, in an order MPICH picks by message size), so
losses agree to the fp64 reduction bound and parameters to that bound carried through Adam
(tests/support/numerics.py). Across ranks the parameters must be bit-identical (every rank applies
the
same reduced gradient). The launch-path probe runs in fp32: its paths reduce the same buckets
with the same MPI calls, so they agree to the fp32 reduction bound.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from tests.support.dp_workers.cases import CASES, STEPS, case_config
from tests.support.mpi_runs import run_ranks, world_run
from tests.support.numerics import U32, U64, f64, reduction_rtol
from tests.support.serial_reference import Bounds, bounds, train_serially
from trainer.parallel.data.buckets import (
    plan_buckets,
    reduction_schedule,
    wants_quiet_waits,
)
from trainer.training.metrics import read_records

TOKENS = 8 * 32  # global batch x seq_len of every case: the longest sum in a gradient element
RTOL = reduction_rtol(TOKENS + 32)  # + d_model: the sums inside each matmul
FP32_RTOL = reduction_rtol(TOKENS + 32, U32)


def tolerances(case: str, fp64: bool = True) -> Bounds:
    return bounds(reference(case, fp64), steps=STEPS, lr=case_config(case).optimizer.lr,
                  n_terms=TOKENS + 32, unit=U64 if fp64 else U32)


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda n: f"dp{n}")
def ranks(request: pytest.FixtureRequest) -> list[dict]:
    """What every rank of one ``mpiexec -n N`` worker run saw, by rank."""
    return world_run("tests.support.dp_workers.equivalence:run", request.param).ranks


@functools.cache
def reference(name: str, fp64: bool = True) -> dict:
    """Single process, whole global batch, no DataParallel: losses, norms, final parameters."""
    return train_serially(case_config(name), STEPS, fp64=fp64)


@pytest.mark.parametrize("case", list(CASES))
def test_losses_match_the_single_process_model(ranks: list[dict], case: str) -> None:
    expected = reference(case)["losses"]
    for rank in ranks:
        torch.testing.assert_close(f64(rank[case]["losses"]),
                                   f64(expected), rtol=RTOL, atol=tolerances(case).loss)


@pytest.mark.parametrize("case", list(CASES))
def test_parameters_match_the_single_process_model(ranks: list[dict], case: str) -> None:
    expected = reference(case)["params"]
    got = ranks[0][case]["params"]
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=tolerances(case).params,
                                   msg=name)


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_ends_with_bit_identical_parameters(ranks: list[dict], case: str) -> None:
    first = ranks[0][case]["params"]
    for rank in ranks[1:]:
        assert all(torch.equal(rank[case]["params"][n], first[n]) for n in first)


@pytest.mark.parametrize("case", list(CASES))
def test_buckets_launch_in_index_order_every_step(ranks: list[dict], case: str) -> None:
    for rank in ranks:
        nb = rank[case]["buckets"]
        assert rank[case]["orders"] == [list(range(nb))] * STEPS


def test_small_bucket_case_keeps_many_buckets_in_flight(ranks: list[dict]) -> None:
    assert ranks[0]["small_buckets"]["buckets"] >= 8
    assert ranks[0]["one_bucket"]["buckets"] == 1


def test_no_sync_microbatches_launch_nothing_and_the_last_one_reduces(ranks: list[dict]) -> None:
    probes = [rank["no_sync"] for rank in ranks]
    for probe in probes:
        assert probe["launched_inside"] == 0
        assert probe["launched"] == list(range(len(probe["launched"])))
    for probe in probes[1:]:
        assert not torch.equal(probe["local"], probes[0]["local"])  # each rank's own data
        assert torch.equal(probe["synced"], probes[0]["synced"])    # averaged everywhere


def test_thread_native_async_and_sync_launch_paths_reduce_to_the_same_gradients(
        ranks: list[dict]) -> None:
    for rank in ranks:
        got = rank["async_paths"]
        assert got["thread_order"] == got["native_order"] == got["sync_order"]
        assert len(got["thread_order"]) > 4
        scale = float(got["thread"].abs().max())
        torch.testing.assert_close(got["native"], got["thread"], rtol=0, atol=FP32_RTOL * scale)
        torch.testing.assert_close(got["sync"], got["thread"], rtol=0, atol=FP32_RTOL * scale)
        torch.testing.assert_close(got["thread"], ranks[0]["async_paths"]["thread"], rtol=0,
                                   atol=0)


def test_parameter_without_gradient_is_named_instead_of_hanging(ranks: list[dict]) -> None:
    for rank in ranks:
        assert "parameters got no gradient [spare.bias, spare.weight]" in rank["unused"]
        assert "allow_unused=True" in rank["unused"]


def test_allowed_unused_parameters_reduce_what_earlier_microbatches_left_or_zero(
        ranks: list[dict]) -> None:
    mean = (len(ranks) + 1) / 2  # of rank + 1 over the ranks
    for rank in ranks:
        late, idle = rank["allow_unused"]["late"], rank["allow_unused"]["idle"]
        assert torch.equal(late["weight"], torch.full((4, 4), mean))
        assert torch.equal(late["bias"], torch.ones(4))
        assert torch.equal(idle["weight"], torch.zeros(4, 4))
        assert torch.equal(idle["bias"], torch.zeros(4))


def test_second_backward_outside_no_sync_is_refused(ranks: list[dict]) -> None:
    for rank in ranks:
        assert "gradient arrived twice" in rank["second_backward"]
        assert "no_sync()" in rank["second_backward"]


def test_ranks_holding_different_models_are_refused_before_any_bucket(ranks: list[dict]) -> None:
    if len(ranks) == 1:
        pytest.skip("needs dp > 1")
    for r, rank in enumerate(ranks):
        assert f"data-parallel ranks hold different models [dp rank {r}]" in rank["mismatch"]


def test_buckets_follow_reverse_parameter_order_and_never_split_a_parameter() -> None:
    numels = [5, 3, 8, 1, 1, 2]
    plan = plan_buckets(numels, 6)
    assert [(s, e, list(idx)) for s, e, idx in plan] == [
        (0, 8, [0, 1]), (8, 16, [2]), (16, 20, [3, 4, 5])]


@pytest.mark.parametrize(("backend", "local_ranks", "cores", "schedule", "quiet"), [
    ("mpi", 1, 2, "thread", False), ("mpi", 7, 8, "thread", False),
    ("mpi", 2, 2, "sync", False), ("mpi", 3, 2, "sync", True), ("mpi", 4, 2, "sync", True),
    ("nccl", 1, 64, "hooks", False), ("nccl", 8, 2, "hooks", False)])
def test_mpi_overlaps_on_a_comm_thread_given_a_spare_core_else_reduces_after_backward(
        backend: str, local_ranks: int, cores: int, schedule: str, quiet: bool) -> None:
    assert reduction_schedule(backend, local_ranks=local_ranks, cores=cores) == schedule
    assert wants_quiet_waits(backend, local_ranks=local_ranks, cores=cores) is quiet


def test_one_huge_bucket_size_gives_a_single_bucket() -> None:
    assert [(s, e) for s, e, _ in plan_buckets([4, 4, 4], 10**9)] == [(0, 12)]


def test_dp2_run_resumes_on_one_process_and_matches_the_reference(tmp_path: Path) -> None:
    """End to end through ``python -m trainer.train``: 2 ranks train and checkpoint, then one
    process resumes (dp is not a sharded axis) and finishes; every loss matches the reference."""
    cfg = case_config("one_bucket")
    flags = ["-m", "trainer.train", "--model", "tiny", "--n-layer", "2", "--d-model", "32",
             "--seq-len", "32", "--global-batch", "8", "--lr", str(cfg.optimizer.lr),
             "--warmup-steps", "1",
             "--seed", str(cfg.seed), "--data-cap-mb", str(cfg.data.data_cap_mb),
             "--run-dir", str(tmp_path), "--steps", str(STEPS)]
    first = run_ranks(2, [*flags, "--stop-at", "2"])
    assert first.returncode == 0, first.stdout[-3000:]
    # The run reduces during backward only where this host has a core to spare for it.
    overlaps = reduction_schedule("mpi", local_ranks=2) != "sync"
    assert f"overlap {'on' if overlaps else 'off'}" in first.stdout
    second = run_ranks(1, [*flags, "--resume"])
    assert second.returncode == 0, second.stdout[-3000:]
    assert "resumed at step 2" in second.stdout
    losses = [r["loss"] for r in read_records(tmp_path / "metrics.jsonl")]
    # This run is fp32, as users run it: an fp32 reference (fp64 would draw other initial
    # weights from the same seed) and fp32 bounds.
    atol = tolerances("one_bucket", fp64=False).loss
    expected = f64(reference("one_bucket", fp64=False)["losses"])
    torch.testing.assert_close(f64(losses), expected, rtol=FP32_RTOL, atol=atol)
    assert (tmp_path / "loss.png").stat().st_size > 0
