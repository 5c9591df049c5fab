"""Megatron-style data parallelism on the `Communicator` (not torch DDP).

Every DP rank holds the whole model. Gradients live in ONE contiguous fp32 buffer laid out in
*reverse* parameter order (roughly the order backward produces them) and cut into buckets of
about ``bucket_size`` elements (a parameter is never split). ``param.main_grad`` is the
parameter's view of the buffer.

The buffer is never zeroed. `zero_grad` leaves every ``param.grad`` None; a post-accumulate-grad
hook on each parameter writes the first gradient autograd produces into the buffer, multiplied by
1/dp on the synchronised backward (Megatron's gradient_scaling_factor, so the all-reduce's SUM is
the mean): one pass over the gradient's bytes where zeroing the buffer, accumulating into it and
scaling each bucket took three (a ``zero_`` and a ``mul_`` of the `small` preset's 12.8 MB buffer
took 0.6-0.7 ms each on the 2-core development VM, against a 2.2 ms all-reduce). From then on a
fp32 parameter's ``.grad`` *is* its view, so later microbatches accumulate straight into the buffer
(torch DDP's ``gradient_as_bucket_view``). The hook then marks the parameter ready; when every
parameter of a bucket is ready its all-reduce is started asynchronously, so it runs while backward
computes the next buckets. Buckets are launched strictly in index order (bucket k only after
buckets < k), so every rank issues the same collectives in the same order whatever order its hooks
fire in. ``finish_grad_sync()`` waits for them all before the optimizer step.

How "asynchronously" is done depends on the backend. NCCL runs the all-reduce on the GPU by
itself, so the communicator's ``async_op=True`` is used as is. MPI progresses a nonblocking
collective only while some MPI call is running, so an ``Iallreduce`` posted from a hook would
mostly run inside the final wait; for MPI the all-reduces are therefore driven, in bucket order,
by one background thread (mpi4py releases the GIL inside MPI calls, and the main thread makes no
call on this communicator until ``finish_grad_sync`` has joined them), as torch's gloo backend
does with its worker threads. The thread tests for completion every ``poll_interval`` seconds
instead of blocking: MPICH busy-polls inside a blocking call, which would take the core that
backward runs on (measured on 2 and 4 ranks of a 2-core host: 10-20% slower steps when it
spins). Which of these runs by default is `reduction_schedule`'s one rule, chosen here for
``overlap`` and ``comm_thread`` left None: the thread only on a host with a core to spare
beyond one per rank (elsewhere its polls only slow the backward down); without that spare core
nothing can run beside the backward at all, and the buckets are reduced after backward, as
MPICH's blocking all-reduce costs a third to a half of the CPU of its nonblocking one.

Gradient accumulation: run every microbatch but the last inside ``no_sync()``; hooks then only
accumulate and the reduction happens once, on the last microbatch's backward (Megatron's
``is_last_microbatch``; the karpathy/build-nanogpt#30 and FunASR#3472 bugs were syncing on the
wrong micro-step). With ``overlap=False`` (the ``sync`` schedule) the buckets are reduced with
blocking calls in ``finish_grad_sync()`` instead.

Failure modes turned into errors instead of hangs: a parameter that got no gradient (its bucket
would never complete, pytorch#43259) is named by ``finish_grad_sync()``; ranks whose models differ
(so their bucket layouts differ, horovod#2107) are refused at construction, before any rank
posts a collective that the others would not match.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Protocol, cast

import torch
from torch import nn

from trainer.comm.protocol import Communicator, Handle, ReduceOp, wait_quietly
from trainer.errors import TrainerError
from trainer.model.precision import main_grad_dtype
from trainer.parallel.data.buckets import (
    Bucket,
    FutureHandle,
    plan_buckets,
    reduction_schedule,
    wants_quiet_waits,
)


class GradSyncError(TrainerError):
    """Data-parallel gradient synchronisation cannot proceed safely."""


class ParamSource(Protocol):
    """What `DataParallel` reads of its model: an `nn.Module`, or part of one
    (`trainer.parallel.data.split.ParamSubset`)."""

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...
    def parameters(self) -> Iterator[nn.Parameter]: ...
    def buffers(self) -> Iterator[torch.Tensor]: ...


class DataParallel:
    """Gradient synchronisation for ``model`` across the DP communicator ``comm``."""

    def __init__(self, model: ParamSource, comm: Communicator, *, bucket_size: int = 1_000_000,
                 overlap: bool | None = None, allow_unused: bool = False,
                 comm_thread: bool | None = None, poll_interval: float = 2e-4,
                 reduce_dtype: torch.dtype | None = None, grads_to_params: bool = True) -> None:
        schedule = reduction_schedule(comm.backend)
        self.model, self.comm = model, comm
        self.overlap = schedule != "sync" if overlap is None else overlap
        self.grads_to_params = grads_to_params
        self.poll_interval = poll_interval
        self._hurry = threading.Event()
        self.allow_unused = allow_unused
        self.launch_order: list[int] = []
        """Bucket indices in the order they were launched since the last zero_grad()."""
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._names = {id(p): n for n, p in reversed(named)}
        self.params = [p for _, p in reversed(named)]
        self.buffer = self._make_buffer()
        self._check_same_model_everywhere()
        self._broadcast_from_rank0()
        self.buckets = self._make_buckets(bucket_size, reduce_dtype or self.buffer.dtype)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._sync, self._next = True, 0
        self._fresh: set[int] = set()
        """Parameters (ids) with no gradient in the buffer since `zero_grad`."""
        if comm_thread is None:
            comm_thread = schedule == "thread"
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="dp-grad-sync") \
            if comm_thread and self.overlap and comm.size > 1 else None
        self._quiet_waits = self._thread is None and wants_quiet_waits(comm.backend)
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.zero_grad()

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Every gradient buffer this sync holds (one; a split sync's parts' together)."""
        return [self.buffer]

    @property
    def uses_comm_thread(self) -> bool:
        return self._thread is not None

    # -- set-up ------------------------------------------------------------------------------

    def _make_buffer(self) -> torch.Tensor:
        device = self.params[0].device if self.params else torch.device("cpu")
        dtype = main_grad_dtype({p.dtype for p in self.params})
        buffer = torch.zeros(sum(p.numel() for p in self.params), dtype=dtype, device=device)
        offset = 0
        # main_grad is this sync's own attribute on the parameters, which torch's stubs do
        # not know: its every use here is an ignore[attr-defined].
        for p in self.params:
            p.main_grad = buffer[offset:offset + p.numel()].view_as(p)  # type: ignore[attr-defined]
            offset += p.numel()
        return buffer

    def _make_buckets(self, bucket_size: int, reduce_dtype: torch.dtype) -> list[Bucket]:
        plan = plan_buckets([p.numel() for p in self.params], bucket_size)
        wire = reduce_dtype != self.buffer.dtype and self.comm.size > 1
        return [Bucket(k, self.buffer[start:end], [self.params[i] for i in idx],
                        wire=self.buffer.new_empty(end - start, dtype=reduce_dtype) if wire
                        else None)
                for k, (start, end, idx) in enumerate(plan)]

    def _check_same_model_everywhere(self) -> None:
        """Compare a digest of (name, shape, dtype) over the ranks with one tiny all-reduce."""
        text = ";".join(f"{self._names[id(p)]}:{tuple(p.shape)}:{p.dtype}" for p in self.params)
        digest = zlib.crc32(text.encode())
        probe = torch.tensor([digest, -digest], dtype=torch.int64, device=self.buffer.device)
        self.comm.all_reduce(probe, ReduceOp.MAX)
        if int(probe[0]) != digest or -int(probe[1]) != digest:
            raise GradSyncError(
                "data-parallel ranks hold different models", f"dp rank {self.comm.rank}",
                "the parameter names, shapes or dtypes differ between ranks, so their gradient "
                "buckets would not match and the all-reduces would mix unrelated tensors",
                "Build the same model config on every rank")

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        """Start from rank 0's weights and buffers (one flat broadcast per dtype)."""
        if self.comm.size == 1:
            return
        tensors = [p.data for p in self.model.parameters()] + list(self.model.buffers())
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            group = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.reshape(-1) for t in group])
            self.comm.broadcast(flat, 0)
            for t, part in zip(group, flat.split([t.numel() for t in group]), strict=True):
                t.copy_(part.view_as(t))

    # -- the training-step API ---------------------------------------------------------------

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (every microbatch but the last)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def zero_grad(self) -> None:
        """Start a step with no gradient held: each parameter's first gradient since is written
        into its view of the buffer by its hook (`_take`), so the buffer is never zeroed."""
        for p in self.params:
            p.grad = None
        self._fresh = {id(p) for p in self.params}
        self._reset_buckets()
        self.launch_order = []

    def finish_grad_sync(self) -> None:
        """Finish (or, with overlap off, run) every bucket's all-reduce; grads are then averaged
        over the DP ranks and ready for the optimizer."""
        if not self._sync:
            raise GradSyncError("finish_grad_sync called inside no_sync()", "data parallel",
                                "gradients of non-final microbatches are never reduced",
                                "Run the last microbatch's backward outside no_sync()")
        self._check_all_ready()
        self._hurry.set()
        if not self.overlap and self._quiet_waits and self.comm.size > 1:
            # Ranks sharing cores: wait for the last one's backward with sleeps, not inside
            # the first blocking all-reduce, which would spin on a core that rank computes on.
            self._wait(self.comm.all_reduce(torch.zeros(1), async_op=True))
        self._launch_ready(final=True)
        for bucket in self.buckets:
            self._wait(bucket.handle)
            self._unwire(bucket)
        for p in self.params:  # unless a MainParams steps on main_grad itself
            if p.dtype != self.buffer.dtype and self.grads_to_params:
                p.grad = p.main_grad.to(p.dtype)  # type: ignore[attr-defined]
        self._reset_buckets()

    # -- hooks and launching -----------------------------------------------------------------

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._sync:
            self._take(p, scale=False)
            return
        bucket = self._bucket_of[id(p)]
        if bucket.launched or id(p) in bucket.ready:
            raise GradSyncError("gradient arrived twice in one synchronised backward",
                                self._names[id(p)],
                                "a second backward ran outside no_sync() before "
                                "finish_grad_sync(), so its bucket was already reduced",
                                "Wrap every microbatch but the last in no_sync()")
        self._take(p, scale=self.comm.size > 1)
        bucket.ready.add(id(p))
        if self.overlap:
            self._launch_ready(final=False)
            if self._thread is None:
                self._poll()

    def _launch_ready(self, *, final: bool) -> None:
        """Launch complete buckets in index order; ``final`` launches every remaining one."""
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if not final and len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket, async_op=self.overlap)
            self._next += 1

    def _take(self, p: nn.Parameter, *, scale: bool) -> None:
        """Move autograd's gradient of ``p`` into its view of the buffer: written there if it
        is the first since `zero_grad`, else added (or, for a parameter of the buffer's dtype,
        already accumulated there by autograd); on the synchronised backward (``scale``) then
        multiplied by 1/dp. Each element gets the value that zeroing, accumulating and scaling
        gave, (0 + g1 + ... + gk) / dp, but for a zero's sign (-0 stays -0, where 0 + -0 was
        +0)."""
        main, grad = p.main_grad, cast(torch.Tensor, p.grad)  # type: ignore[attr-defined]
        if id(p) in self._fresh:
            self._fresh.discard(id(p))
            if scale and grad.dtype == main.dtype:
                torch.mul(grad, 1.0 / self.comm.size, out=main)
                scale = False
            else:
                main.copy_(grad)
        elif grad.data_ptr() != main.data_ptr():
            main.add_(grad)  # a non-fp32 parameter's, or someone set .grad to None
        if scale:
            main.mul_(1.0 / self.comm.size)
        p.grad = main if p.dtype == self.buffer.dtype else None

    def _settle(self, bucket: Bucket) -> None:
        """Before a bucket is reduced, its parameters that had no gradient on the synchronised
        backward (``allow_unused``): zeroed if they had none since `zero_grad`, else scaled
        by 1/dp like the rest."""
        for p in bucket.params:
            if id(p) not in bucket.ready:
                if id(p) in self._fresh:
                    self._fresh.discard(id(p))
                    p.main_grad.zero_()  # type: ignore[attr-defined]
                    p.grad = p.main_grad if p.dtype == self.buffer.dtype else None  # type: ignore[attr-defined]
                elif self.comm.size > 1:
                    p.main_grad.mul_(1.0 / self.comm.size)  # type: ignore[attr-defined]

    def _launch(self, bucket: Bucket, *, async_op: bool) -> None:
        if len(bucket.ready) < len(bucket.params):
            self._settle(bucket)
        bucket.launched = True
        self.launch_order.append(bucket.index)
        if self.comm.size == 1:
            return
        if not async_op:
            self._post(bucket, async_op=False)
        elif self._thread is not None:
            bucket.handle = FutureHandle(self._thread.submit(self._reduce_polled, bucket))
        else:
            bucket.handle = self._post(bucket, async_op=True)

    def _post(self, bucket: Bucket, *, async_op: bool) -> Handle | None:
        """Start (or, blocking, run) the reduction of one bucket: the all-reduce here; ZeRO's
        sharded variant (`trainer.parallel.zero.grad_sync`) reduce-scatters instead."""
        return self.comm.all_reduce(self._wire(bucket), ReduceOp.SUM, async_op=async_op)

    def _unwire(self, bucket: Bucket) -> None:
        """After a bucket's reduction: copy a narrower reduce dtype's result back."""
        if bucket.wire is not None:
            bucket.view.copy_(bucket.wire)

    def _wire(self, bucket: Bucket) -> torch.Tensor:
        """The bucket (its gradients already scaled by 1/dp in the hooks, `_take`), rounded to
        the reduce dtype when that is narrower (`finish_grad_sync` copies the result back)."""
        return bucket.view if bucket.wire is None else bucket.wire.copy_(bucket.view)

    def _wait(self, handle: Handle | None) -> None:
        """Wait for one bucket's reduction: polled with short sleeps where ranks share cores
        on MPI (`wants_quiet_waits`), else (a core per rank, a comm thread's handle, NCCL)
        waited on as is."""
        if handle is None:
            return
        if self._quiet_waits:
            wait_quietly(handle, self.poll_interval)
        else:
            handle.wait()

    def _reduce_polled(self, bucket: Bucket) -> None:
        """The comm thread's reduction: post it, then drive MPI progress with short sleeps
        rather than a blocking call, which would spin a core the backward needs; once
        finish_grad_sync is waiting (``_hurry``) there is no compute left, so block."""
        wait_quietly(self._post(bucket, async_op=True), self.poll_interval, hurry=self._hurry)

    def _poll(self) -> None:
        """Let backends that progress only inside library calls (MPI) advance in-flight
        reductions while backward runs; the oldest unfinished one is enough."""
        for bucket in self.buckets[:self._next]:
            if bucket.handle is not None and not bucket.handle.is_completed():
                return

    def _check_all_ready(self) -> None:
        missing = [self._names[id(p)] for b in self.buckets for p in b.params
                   if id(p) not in b.ready]
        if missing and not self.allow_unused:
            for bucket in self.buckets[:self._next]:  # leave no request in flight
                if bucket.handle is not None:
                    bucket.handle.wait()
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise GradSyncError("parameters got no gradient", shown,
                                f"{len(missing)} parameter(s) took no part in the loss, so "
                                "their buckets never completed",
                                "Use every parameter in the forward pass, freeze the unused "
                                "ones (requires_grad=False), or pass allow_unused=True")

    def _reset_buckets(self) -> None:
        self._hurry.clear()
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.handle, bucket.launched = None, False
        self._next = 0
