"""ZeRO-2 (``--zero 2``): gradients reduce-scattered into each rank's shard during backward,
trained with real MPI ranks (`tests/support/zero_workers/stage2.py`), equal to the single-process
model
and holding only its shards of the gradients.

Tolerances (tests/support/numerics.py), as for ZeRO-1 (tests/trainer/test_zero.py): in fp64 the
layouts differ
from the single-process model only by summation order (a microbatch's gradients are reduced
before they are added to the previous microbatch's, the norm summed over shards), so losses
agree to the fp64 reduction bound over the longest sum, and parameters to that bound carried
through Adam. With one microbatch zero 1 and zero 2 run the same operations on the same
numbers (a zeroed buffer plus a gradient, the same reduce-scatter, the same pieces), so there
they must agree bit for bit, in fp32, in bf16 and reduced in bf16; resuming across the stages
must then be bit-exact too.
"""

from __future__ import annotations

import functools
import re
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.support import run_dtrain
from tests.support.mpi_runs import forked_python, world_run
from tests.support.numerics import f64, reduction_rtol
from tests.support.saved import same_states, saved_state
from tests.support.serial_reference import Bounds, bounds, train_serially
from tests.support.zero_workers.stage2 import PAIRS, STAGE2_CASES, STEPS, stage2_config
from tests.trainer.test_guard import DIVERGING
from trainer.comm.protocol import DoneHandle, Handle, ReduceOp
from trainer.config.options import make_config
from trainer.errors import ConfigError
from trainer.parallel.data.grad_sync import GradSyncError
from trainer.parallel.zero.grad_shards import IN_FLIGHT, ShardedGradients
from trainer.parallel.zero.memory import describe, expected_bytes

WORKER = "tests.support.zero_workers.stage2:run"
TOKENS = 8 * 32 + 32  # global batch x seq_len, + d_model: the longest sum in any element
RTOL = reduction_rtol(TOKENS)
LR = 3e-3
NAMES = [name for name, *_ in STAGE2_CASES]


@functools.cache
def ranks(world: int) -> list[dict]:
    return world_run(WORKER, world).ranks


@functools.cache
def reference(name: str) -> dict:
    return train_serially(stage2_config(name, zero=2), STEPS)  # one process: zero is moot


def tolerances(name: str) -> Bounds:
    return bounds(reference(name), steps=STEPS, lr=LR, n_terms=TOKENS)


# -- the gradient shards, in one process (an in-memory mirror of a second rank) ----------------

class Mirror:
    """DP rank 0 of 2 whose partner computes exactly what it computes: a reduce-scatter's SUM
    is twice this rank's block (the minimum of what `ShardedGradients` calls)."""

    rank, size, name, backend = 0, 2, "dp", "fake"

    def __init__(self) -> None:
        self.scatters = 0

    def all_reduce(self, t: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *,
                   async_op: bool = False) -> Handle | None:
        return DoneHandle() if async_op else None  # MAX of equal digests: unchanged

    def broadcast(self, t: torch.Tensor, src: int, *, async_op: bool = False) -> Handle | None:
        return DoneHandle() if async_op else None

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                       *, async_op: bool = False) -> Handle | None:
        self.scatters += 1
        out.copy_(2 * inp[:out.numel()])
        return DoneHandle() if async_op else None


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Linear(3, 1))


def _whole_grads(model: nn.Module, batches: list[torch.Tensor]) -> torch.Tensor:
    """Autograd's gradients over ``batches``, in the sync's buffer order, flattened."""
    model.zero_grad()
    for x in batches:
        model(x).sum().backward()
    return torch.cat([p.grad.reshape(-1) for p in reversed(list(model.parameters()))])


@pytest.mark.parametrize("overlap", [True, False])
def test_each_microbatch_is_reduce_scattered_into_the_shard_and_accumulates_there(
        overlap: bool) -> None:
    model, comm = _model(), Mirror()
    batches = [torch.randn(4, 5) for _ in range(3)]
    want = _whole_grads(model, batches)
    sync = ShardedGradients(model, comm, bucket_size=20, overlap=overlap)
    sync.zero_grad()
    for i, x in enumerate(batches):
        with sync.no_sync() if i < len(batches) - 1 else nullcontext():
            model(x).sum().backward()
    sync.finish_grad_sync()
    layout = sync.layout
    assert comm.scatters == len(layout.buckets) * len(batches)
    for piece in layout.pieces():
        at = sum(n for n in layout.numels[:piece.param])
        got = sync.shard_grad(piece.bucket)[piece.at:piece.at + piece.hi - piece.lo]
        torch.testing.assert_close(got, want[at + piece.lo:at + piece.hi])
    assert all(p.grad is None for p in model.parameters())
    assert sync.staged_bytes == 0 and sync.buffer.numel() == layout.size // 2


def test_the_staged_buckets_never_hold_the_whole_gradient() -> None:
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(8)))
    sync = ShardedGradients(model, Mirror(), bucket_size=200, overlap=True)
    model(torch.randn(2, 16)).sum().backward()
    sync.finish_grad_sync()
    biggest = max(b.end - b.start for b in sync.layout.buckets) * 4
    assert 0 < sync.peak_staged_bytes <= (IN_FLIGHT + 1) * biggest
    assert sync.peak_staged_bytes < sync.layout.size * 4 / 2


def test_a_gradient_arriving_twice_in_one_round_is_an_error_naming_the_parameter() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    sync = ShardedGradients(model, Mirror(), bucket_size=10**6)  # one bucket: stays open
    x = torch.randn(2, 4)
    model[1](x).sum().backward()  # only the second layer: the round stays open
    with pytest.raises(GradSyncError, match=r"gradient arrived twice.*\[1\.(weight|bias)\]"):
        model[1](x).sum().backward()
    assert sync.launch_order == []  # nothing was reduced from the mixed sums


def test_a_parameter_without_gradient_is_named_and_nothing_is_left_staged() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    sync = ShardedGradients(model, Mirror(), bucket_size=10**6)
    model[1](torch.randn(2, 4)).sum().backward()
    with pytest.raises(GradSyncError, match=r"parameters got no gradient \[0\.bias, 0\.weight"):
        sync.finish_grad_sync()
    assert sync.staged_bytes == 0


# -- bad input (pure) ----------------------------------------------------------------------

def test_zero2_with_the_interleaved_schedule_is_refused_before_anything_is_built() -> None:
    with pytest.raises(ConfigError, match=r"unsupported combination \[--zero 2 with --schedule "
                                          r"interleaved \(v 2\)\]: .*Use --schedule 1f1b"):
        make_config({"zero": 2, "dp": 2, "pp": 2, "schedule": "interleaved",
                     "virtual_stages": 2, "microbatches": 4}, {"n_layer": 4})


def test_zero2_with_experts_is_refused_naming_the_stage() -> None:
    with pytest.raises(ConfigError, match=r"--moe-experts 4 with --zero 2\]"):
        make_config({"zero": 2, "dp": 2}, {"moe_experts": 4})


# -- memory (pure) -------------------------------------------------------------------------

@pytest.mark.parametrize(("bf16", "per_param"), [(False, 4 + 12 / 4), (True, 2 + 16 / 4)])
def test_zero2_expected_bytes_shard_the_gradients_too(bf16: bool, per_param: float) -> None:
    table = expected_bytes(1000, bf16=bf16, zero=2, dp=4)
    assert table.total == 1000 * per_param and table.grads == 1000
    assert "4 + 12/4 bytes per parameter" in describe(1000, bf16=False, zero=2, dp=4, where="")


# -- equivalence (MPI, 4 ranks, fp64) --------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_zero2_losses_match_the_single_process_model_for_5_steps(name: str) -> None:
    ref, atol = reference(name), tolerances(name).loss
    assert len(ref["losses"]) == STEPS
    for rank in ranks(4):
        torch.testing.assert_close(f64(rank[name][2]["losses"]), f64(ref["losses"]),
                                   rtol=RTOL, atol=atol)


@pytest.mark.parametrize("name", NAMES)
def test_zero2_parameters_match_zero1_on_the_same_layout(name: str) -> None:
    atol = tolerances(name).params  # the same model and data as the reference
    for rank in ranks(4):
        one, two = rank[name][1], rank[name][2]
        assert two["local"].keys() == one["local"].keys()
        for key, want in one["local"].items():
            torch.testing.assert_close(two["local"][key], want, rtol=0, atol=atol,
                                       msg=f"rank {rank['rank']}: {key}")


def test_zero2_dp4_parameters_match_the_single_process_model() -> None:
    ref = reference("dp4")
    for rank in ranks(4):
        for key, want in ref["params"].items():
            torch.testing.assert_close(rank["dp4"][2]["local"][key], want, rtol=0,
                                       atol=tolerances("dp4").params, msg=key)


@pytest.mark.parametrize("zero", [1, 2])
def test_hybrid_sharding_at_zero_1_and_2_matches_the_single_process_model(zero: int) -> None:
    """dp 4 in shard groups of 2: each bucket reduce-scattered inside the group, its shard
    then averaged across the 2 groups, the pieces stepped and (ZeRO-1) all-gathered inside
    the group: the same losses and parameters as one process, within the fp64 bounds."""
    ref, tol = reference("dp4-shard-2"), tolerances("dp4-shard-2")
    for rank in ranks(4):
        got = rank["dp4-shard-2"][zero]
        torch.testing.assert_close(f64(got["losses"]), f64(ref["losses"]), rtol=RTOL,
                                   atol=tol.loss)
        for key, want in ref["params"].items():
            torch.testing.assert_close(got["local"][key], want, rtol=0, atol=tol.params,
                                       msg=f"rank {rank['rank']}: {key}")


@pytest.mark.parametrize("name", NAMES)
def test_zero2_ranks_hold_one_dp_th_of_the_gradients_and_nothing_staged_between_steps(
        name: str) -> None:
    _, dp, _, _, over = next(c for c in STAGE2_CASES if c[0] == name)
    dp = over.get("zero_shard_size") or dp  # hybrid sharding: 1/shard, replicated beyond
    for rank in ranks(4):
        one, two = rank[name][1], rank[name][2]
        want = expected_bytes(two["n_params"], bf16=False, zero=2, dp=dp).grads * 2  # fp64
        assert two["held"].grads == pytest.approx(want, rel=0.05)
        assert two["held"].grads == pytest.approx(one["held"].grads / dp, rel=0.05)
        assert two["held"].optimizer == one["held"].optimizer
        assert [now for now, _ in two["staged"]] == [0] * STEPS


@pytest.mark.parametrize("name", NAMES)
def test_zero2_never_stages_more_than_the_buckets_in_flight(name: str) -> None:
    """The peak of whole-bucket tensors during a step: the buckets reducing (IN_FLIGHT) and
    the ones backward is filling, never the whole gradient."""
    for rank in ranks(4):
        two = rank[name][2]
        biggest = sorted(two["bucket_bytes"], reverse=True)
        bound = sum(biggest[:IN_FLIGHT + 2])
        assert all(0 < peak <= bound for _, peak in two["staged"]), (two["staged"], bound)
        assert max(peak for _, peak in two["staged"]) < two["whole_grad_bytes"]


# -- the NaN guard (the real launcher, 2 ranks) ----------------------------------------------

def test_zero2_skips_diverged_steps_leaving_the_sharded_state_untouched(tmp_path: Path) -> None:
    """dp 2 under --skip-nonfinite: the steps skipped after a NaN apply nothing, so their
    checkpoints hold exactly the last applied step's pieces, and the run then stops."""
    done = run_dtrain(["launch", "--nproc-per-node", "2", "--", *forked_python(), "-m",
                       "trainer.train", *DIVERGING, "--dp", "2", "--zero", "2",
                       "--skip-nonfinite", "2", "--run-dir", str(tmp_path)], timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-3000:]
    # Rank 0's lines as the launcher forwards them: its summary may repeat the tail of
    # whichever rank it names as the first failure (both stop in the same step).
    first, second = map(int, re.findall(r"\[0@localhost\] dtrain: step (\d+) skipped: the "
                                        r"loss is ", out))
    assert second == first + 1
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step-{first}", f"step-{second}"]
    before, after = (saved_state(ckpts / f"step-{s}") for s in (first, second))
    assert same_states(before, after) == []


# -- bit-exact against zero 1 (MPI, 2 ranks, one microbatch) ---------------------------------

@pytest.mark.parametrize("name", list(PAIRS))
def test_zero2_at_one_microbatch_is_bit_identical_to_zero1(name: str) -> None:
    for rank in ranks(2):
        one, two = rank[name][1], rank[name][2]
        assert two["losses"] == one["losses"]
        for key, want in one["local"].items():
            assert torch.equal(two["local"][key], want), key
        assert two["held"].grads * 2 == pytest.approx(one["held"].grads, rel=0.01)


@pytest.mark.parametrize("change", ["2to1", "2to0", "0to2"])
def test_a_run_resumed_at_another_zero_stage_continues_bit_exactly(change: str) -> None:
    for rank in ranks(2):
        got = rank["resume"]
        assert got[change]["start"] == 2
        assert got[change]["losses"] == got["whole"]

