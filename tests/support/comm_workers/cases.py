"""The contract's cases: one operation on one communicator, checked against a serial computation.

Every rank can rebuild every member's input (a seeded generator per case and member), so the
expected result is computed locally, serially, with no communication. Inputs are small integers,
so sums, maxima and averages over 1, 2 or 4 ranks are exact in fp16, bf16, fp32 and int64 and the
comparison is exact equality, whatever order a backend reduces in.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from trainer.comm.protocol import Communicator, Handle, P2POp, ReduceOp

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
          "int64": torch.int64}


@dataclass(frozen=True)
class Group:
    """A communicator under test and its members' global ranks, in sub-rank order."""

    label: str
    comm: Communicator
    members: tuple[int, ...]


@dataclass(frozen=True)
class Ctx:
    group: Group
    dtype: torch.dtype
    async_op: bool
    device: torch.device
    case: str

    @property
    def comm(self) -> Communicator:
        return self.group.comm

    @property
    def n(self) -> int:
        return len(self.group.members)

    def inp(self, member: int, shape: tuple[int, ...], salt: str = "") -> torch.Tensor:
        """Member ``member``'s input (CPU): integers in [-4, 4], fixed by case and member."""
        gen = torch.Generator().manual_seed(zlib.crc32(f"{self.case}|{salt}|{member}".encode()))
        return torch.randint(-4, 5, shape, generator=gen).to(self.dtype)

    def mine(self, shape: tuple[int, ...], salt: str = "") -> torch.Tensor:
        return self.inp(self.comm.rank, shape, salt).to(self.device)

    def all_inputs(self, shape: tuple[int, ...]) -> list[torch.Tensor]:
        return [self.inp(i, shape) for i in range(self.n)]

    def wait(self, handle: Handle | None) -> None:
        if self.async_op:
            assert handle is not None, "async_op=True returned no handle"
            complete([handle])
        else:
            assert handle is None, "a synchronous call returned a handle"


Check = tuple[torch.Tensor, torch.Tensor]  # (actual, expected)


def complete(handles: Sequence[Handle], timeout: float = 60.0) -> None:
    """Poll ``is_completed()`` until every handle says done (every member has posted, so they
    all finish), then ``wait()``; a handle is still complete after its wait."""
    deadline = time.monotonic() + timeout
    while not all(h.is_completed() for h in handles):
        assert time.monotonic() < deadline, f"is_completed() still False after {timeout:g} s"
        time.sleep(1e-4)
    for h in reversed(handles):
        h.wait()
    assert all(h.is_completed() for h in handles), "is_completed() is False after wait()"


def serial_reduce(tensors: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    dtype = tensors[0].dtype
    wide = torch.stack([t.to(torch.float64 if dtype.is_floating_point else torch.int64)
                        for t in tensors])
    if op is ReduceOp.SUM:
        out = wide.sum(0)
    elif op is ReduceOp.MAX:
        out = wide.amax(0)
    elif op is ReduceOp.MIN:
        out = wide.amin(0)
    else:
        out = wide.sum(0) / len(tensors)
    return out.to(dtype)


def all_reduce(ctx: Ctx, op: ReduceOp) -> list[Check]:
    shape = (5, 3)
    t = ctx.mine(shape)
    ctx.wait(ctx.comm.all_reduce(t, op, async_op=ctx.async_op))
    return [(t, serial_reduce(ctx.all_inputs(shape), op))]


def all_reduce_strided(ctx: Ctx) -> list[Check]:
    t = ctx.mine((3, 5)).t()  # a transposed view: not contiguous
    ctx.wait(ctx.comm.all_reduce(t, ReduceOp.SUM, async_op=ctx.async_op))
    return [(t, serial_reduce(ctx.all_inputs((3, 5)), ReduceOp.SUM).t())]


def all_reduce_requires_grad(ctx: Ctx) -> list[Check]:
    p = ctx.mine((4,)).requires_grad_()  # a parameter: exported after .detach()
    ctx.wait(ctx.comm.all_reduce(p, ReduceOp.SUM, async_op=ctx.async_op))
    return [(p.detach(), serial_reduce(ctx.all_inputs((4,)), ReduceOp.SUM))]


def all_gather(ctx: Ctx) -> list[Check]:
    inp = ctx.mine((2, 3))
    out = torch.full((2 * ctx.n, 3), 7, dtype=ctx.dtype, device=ctx.device)
    ctx.wait(ctx.comm.all_gather(out, inp, async_op=ctx.async_op))
    return [(out, torch.cat(ctx.all_inputs((2, 3))))]


def all_gather_in_place(ctx: Ctx) -> list[Check]:
    r = ctx.comm.rank
    out = torch.zeros((2 * ctx.n, 3), dtype=ctx.dtype, device=ctx.device)
    out[2 * r:2 * r + 2] = ctx.mine((2, 3))
    ctx.wait(ctx.comm.all_gather(out, out[2 * r:2 * r + 2], async_op=ctx.async_op))
    return [(out, torch.cat(ctx.all_inputs((2, 3))))]


def reduce_scatter(ctx: Ctx, op: ReduceOp) -> list[Check]:
    r, shape = ctx.comm.rank, (2 * ctx.n, 3)
    out = torch.full((2, 3), 7, dtype=ctx.dtype, device=ctx.device)
    ctx.wait(ctx.comm.reduce_scatter(out, ctx.mine(shape), op, async_op=ctx.async_op))
    return [(out, serial_reduce(ctx.all_inputs(shape), op)[2 * r:2 * r + 2])]


def reduce_scatter_in_place(ctx: Ctx) -> list[Check]:
    """ZeRO's layout (`trainer.parallel.zero`): the output is this rank's block of the input, the
    form
    NCCL calls in place; the other blocks of the input may change, the output must not mix."""
    r, shape = ctx.comm.rank, (2 * ctx.n, 3)
    buf = ctx.mine(shape).clone()
    own = buf[2 * r:2 * r + 2]
    ctx.wait(ctx.comm.reduce_scatter(own, buf, ReduceOp.SUM, async_op=ctx.async_op))
    return [(own, serial_reduce(ctx.all_inputs(shape), ReduceOp.SUM)[2 * r:2 * r + 2])]


def broadcast(ctx: Ctx, src: int) -> list[Check]:
    t = ctx.mine((4, 2))
    ctx.wait(ctx.comm.broadcast(t, src, async_op=ctx.async_op))
    return [(t, ctx.inp(src, (4, 2)))]


def broadcast_strided(ctx: Ctx) -> list[Check]:
    src = ctx.n - 1
    base = ctx.mine((3, 4))
    ctx.wait(ctx.comm.broadcast(base[:, ::2], src, async_op=ctx.async_op))
    expected = ctx.inp(ctx.comm.rank, (3, 4))
    expected[:, ::2] = ctx.inp(src, (3, 4))[:, ::2]  # the odd columns are not part of the view
    return [(base, expected)]


def send_recv(ctx: Ctx) -> list[Check]:
    r, n = ctx.comm.rank, ctx.n
    nxt, prev = (r + 1) % n, (r - 1) % n
    got = torch.zeros((3,), dtype=ctx.dtype, device=ctx.device)
    if r % 2 == 0:  # parity order, so blocking calls pair up
        ctx.comm.send(ctx.mine((3,)), nxt)
        ctx.comm.recv(got, prev)
    else:
        ctx.comm.recv(got, prev)
        ctx.comm.send(ctx.mine((3,)), nxt)
    return [(got, ctx.inp(prev, (3,)))]


def batch_p2p(ctx: Ctx) -> list[Check]:
    """Both directions of a ring at once; every rank sends before it receives."""
    r, n = ctx.comm.rank, ctx.n
    nxt, prev = (r + 1) % n, (r - 1) % n
    from_prev = torch.zeros((2, 3), dtype=ctx.dtype, device=ctx.device)
    from_next = torch.zeros((2, 3), dtype=ctx.dtype, device=ctx.device)
    handles = ctx.comm.batch_p2p([
        P2POp("send", ctx.mine((2, 3), "fwd"), nxt),
        P2POp("send", ctx.mine((2, 3), "bwd"), prev),
        P2POp("recv", from_prev, prev),
        P2POp("recv", from_next, nxt),
    ])
    complete(handles)
    return [(from_prev, ctx.inp(prev, (2, 3), "fwd")), (from_next, ctx.inp(nxt, (2, 3), "bwd"))]


def batch_p2p_empty(ctx: Ctx) -> list[Check]:
    """Nothing to send or receive: the handles are complete before any wait."""
    handles = ctx.comm.batch_p2p([])
    assert handles and all(h.is_completed() for h in handles), "an empty batch is not complete"
    complete(handles)
    return []


def all_to_all(ctx: Ctx) -> list[Check]:
    r, n = ctx.comm.rank, ctx.n
    out = torch.full((2 * n, 3), 7, dtype=ctx.dtype, device=ctx.device)
    ctx.comm.all_to_all(out, ctx.mine((2 * n, 3)))
    expected = torch.cat([x[2 * r:2 * r + 2] for x in ctx.all_inputs((2 * n, 3))])
    return [(out, expected)]


def _uneven(ctx: Ctx, rows_of: Callable[[int, int], int], salt: str) -> list[Check]:
    """Member i sends ``rows_of(i, j)`` rows to member j; out gathers what each sent here."""
    r, n = ctx.comm.rank, ctx.n
    sent = [ctx.inp(i, (sum(rows_of(i, j) for j in range(n)), 3), salt) for i in range(n)]
    block = [list(torch.split(x, [rows_of(i, j) for j in range(n)])) for i, x in enumerate(sent)]
    expected = torch.cat([block[j][r] for j in range(n)])
    out = torch.full(tuple(expected.shape), 7, dtype=ctx.dtype, device=ctx.device)
    ctx.wait(ctx.comm.all_to_all(
        out, sent[r].to(ctx.device), in_splits=[rows_of(r, j) for j in range(n)],
        out_splits=[rows_of(j, r) for j in range(n)], async_op=ctx.async_op))
    return [(out, expected)]


def all_to_all_uneven(ctx: Ctx) -> list[Check]:
    """Different row counts per pair, some of them zero (every third pair sends nothing)."""
    return _uneven(ctx, lambda i, j: (i + 2 * j) % 3, "uneven")


def all_to_all_all_to_one(ctx: Ctx) -> list[Check]:
    """Every member sends everything to member 0 (one expert gets every token): the others
    receive nothing and send nothing to each other."""
    return _uneven(ctx, lambda i, j: 2 + i if j == 0 else 0, "to_one")


def all_to_all_empty(ctx: Ctx) -> list[Check]:
    """No member sends anything: empty tensors on every rank, and the call still completes."""
    return _uneven(ctx, lambda i, j: 0, "empty")


def many_in_flight(ctx: Ctx) -> list[Check]:
    """Three async operations outstanding at once, waited for in reverse order."""
    a, b, c = ctx.mine((4,), "a"), ctx.mine((4,), "b"), ctx.mine((4,), "c")
    handles = [ctx.comm.all_reduce(a, ReduceOp.SUM, async_op=True),
               ctx.comm.broadcast(b, 0, async_op=True),
               ctx.comm.all_reduce(c, ReduceOp.MAX, async_op=True)]
    for h in reversed(handles):
        h.wait()
    return [(a, serial_reduce([ctx.inp(i, (4,), "a") for i in range(ctx.n)], ReduceOp.SUM)),
            (b, ctx.inp(0, (4,), "b")),
            (c, serial_reduce([ctx.inp(i, (4,), "c") for i in range(ctx.n)], ReduceOp.MAX))]


def barrier(ctx: Ctx) -> list[Check]:
    ctx.comm.barrier()
    return []


def plan(ctx: Ctx) -> list[tuple[str, Callable[[], list[Check]]]]:
    """The (op name, thunk) pairs for one communicator, dtype and sync/async choice."""
    ops = [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN]
    if ctx.dtype.is_floating_point:
        ops.append(ReduceOp.AVG)
    out: list[tuple[str, Callable[[], list[Check]]]] = []
    out += [(f"all_reduce_{op.value}", lambda op=op: all_reduce(ctx, op)) for op in ops]
    out += [("all_reduce_strided", lambda: all_reduce_strided(ctx)),
            ("all_gather", lambda: all_gather(ctx)),
            ("all_gather_in_place", lambda: all_gather_in_place(ctx)),
            ("reduce_scatter_sum", lambda: reduce_scatter(ctx, ReduceOp.SUM)),
            ("reduce_scatter_max", lambda: reduce_scatter(ctx, ReduceOp.MAX)),
            ("reduce_scatter_in_place", lambda: reduce_scatter_in_place(ctx)),
            ("broadcast_first", lambda: broadcast(ctx, 0)),
            ("broadcast_last", lambda: broadcast(ctx, ctx.n - 1)),
            ("broadcast_strided", lambda: broadcast_strided(ctx)),
            ("all_to_all_uneven", lambda: all_to_all_uneven(ctx)),
            ("all_to_all_all_to_one", lambda: all_to_all_all_to_one(ctx)),
            ("all_to_all_empty", lambda: all_to_all_empty(ctx))]
    if ctx.dtype.is_floating_point:
        out.append(("all_reduce_requires_grad", lambda: all_reduce_requires_grad(ctx)))
    if ctx.async_op:
        out += [("batch_p2p", lambda: batch_p2p(ctx)),
                ("batch_p2p_empty", lambda: batch_p2p_empty(ctx)),
                ("many_in_flight", lambda: many_in_flight(ctx))]
    else:
        out += [("all_to_all", lambda: all_to_all(ctx)), ("barrier", lambda: barrier(ctx))]
        if ctx.n > 1:
            out.append(("send_recv", lambda: send_recv(ctx)))
    return out
