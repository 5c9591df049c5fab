"""Argument checks shared by the backends, run before any rank talks to another.

A wrong shape passed to MPI or NCCL either hangs the job or silently reads past a buffer, so each
operation validates its tensors first and raises a `CommError` that names the operation, the
communicator and rank, the mismatch and the fix. Everything here is pure and local: a failing
check never leaves the other ranks half-way through a collective that this rank started.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from trainer.comm.protocol import ReduceOp
from trainer.errors import CommError


def where(backend: str, name: str, rank: int, size: int) -> str:
    """The ``[where]`` part of a message: backend, communicator, rank of size."""
    return f"{backend} communicator {name!r}, rank {rank} of {size}"


def check_device(op: str, loc: str, t: torch.Tensor, device_type: str) -> None:
    if t.device.type != device_type:
        other = "NCCL (init(backend='nccl'))" if t.device.type == "cuda" else "MPI"
        raise CommError(
            f"{op} failed", loc,
            f"the tensor is on {t.device} but this backend moves {device_type} tensors",
            f"Move the tensor to {device_type} first or use the {other} backend",
        )


def check_reduce(op_name: str, loc: str, t: torch.Tensor, op: ReduceOp) -> None:
    if not isinstance(op, ReduceOp):
        raise CommError(
            f"{op_name} failed", loc, f"{op!r} is not a ReduceOp",
            "Pass ReduceOp.SUM, MAX, MIN or AVG",
        )
    if op is ReduceOp.AVG and not t.dtype.is_floating_point:
        raise CommError(
            f"{op_name} failed", loc, f"ReduceOp.AVG is undefined for {t.dtype} tensors",
            "Reduce with SUM and divide, or convert the tensor to a floating-point dtype",
        )


def check_same_dtype(op: str, loc: str, out: torch.Tensor, inp: torch.Tensor) -> None:
    if out.dtype != inp.dtype:
        raise CommError(
            f"{op} failed", loc, f"out is {out.dtype} but inp is {inp.dtype}",
            "Allocate out with inp's dtype",
        )


def check_gather(op: str, loc: str, out: torch.Tensor, inp: torch.Tensor, size: int) -> None:
    """``out`` holds ``size`` blocks of ``inp``'s shape, concatenated on dim 0."""
    check_same_dtype(op, loc, out, inp)
    want = (size * _rows(inp), *inp.shape[1:])
    if tuple(out.shape) != want:
        raise CommError(
            f"{op} failed", loc,
            f"out has shape {tuple(out.shape)} but {size} blocks of inp {tuple(inp.shape)} "
            f"need {want}",
            "Allocate out with shape (size * inp.shape[0], *inp.shape[1:])",
        )


def check_scatter(op: str, loc: str, out: torch.Tensor, inp: torch.Tensor, size: int) -> None:
    """``inp`` is ``size`` blocks of ``out``'s shape, concatenated on dim 0."""
    check_same_dtype(op, loc, out, inp)
    want = (size * _rows(out), *out.shape[1:])
    if tuple(inp.shape) != want:
        raise CommError(
            f"{op} failed", loc,
            f"inp has shape {tuple(inp.shape)} but {size} blocks of out {tuple(out.shape)} "
            f"make {want}",
            "Make inp.shape[0] equal size * out.shape[0] with the other dims equal",
        )


def check_all_to_all(
    loc: str,
    out: torch.Tensor,
    inp: torch.Tensor,
    size: int,
    in_splits: Sequence[int] | None = None,
    out_splits: Sequence[int] | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The rows ``inp`` sends to and ``out`` receives from each member, checked.

    ``None`` splits mean equal blocks; with both ``None`` the two tensors must have one shape.
    That ``in_splits`` of every member match the ``out_splits`` of its peers cannot be seen by
    one rank; it is the caller's contract (exchange the counts first, as MoE dispatch does).
    """
    check_same_dtype("all_to_all", loc, out, inp)
    if out.dim() == 0 or inp.dim() == 0 or tuple(out.shape[1:]) != tuple(inp.shape[1:]):
        raise CommError(
            "all_to_all failed", loc,
            f"inp {tuple(inp.shape)} and out {tuple(out.shape)} must be at least 1-d with equal "
            "trailing dims (rows are exchanged along dim 0)",
            "Reshape both to (rows, *row_shape) with the same row shape",
        )
    if in_splits is None and out_splits is None and tuple(out.shape) != tuple(inp.shape):
        raise CommError(
            "all_to_all failed", loc,
            f"inp {tuple(inp.shape)} and out {tuple(out.shape)} differ but no splits were given",
            "Pass in_splits and out_splits, or give out the shape of inp",
        )
    return (_splits("in_splits", loc, in_splits, inp.shape[0], size),
            _splits("out_splits", loc, out_splits, out.shape[0], size))


def _splits(role: str, loc: str, splits: Sequence[int] | None, rows: int, size: int
            ) -> tuple[int, ...]:
    if splits is None:
        if rows % size:
            raise CommError(
                "all_to_all failed", loc,
                f"{rows} rows do not divide into {size} equal blocks and no {role} were given",
                f"Pad dim 0 to a multiple of {size}, or pass {role} (rows per member)",
            )
        return (rows // size,) * size
    try:  # numpy and 0-d torch integers are counts too
        got = tuple(operator.index(n) for n in splits)
    except TypeError:
        got = ()
    if len(got) != size or any(n < 0 for n in got):
        raise CommError(
            "all_to_all failed", loc, f"{role} {list(splits)} is not {size} row counts >= 0",
            f"Pass one non-negative int per member of this communicator ({size})",
        )
    if sum(got) != rows:
        raise CommError(
            "all_to_all failed", loc,
            f"{role} {list(got)} sum to {sum(got)} but the tensor has {rows} rows",
            "Make the splits add up to the tensor's dim 0",
        )
    return got


def check_peer(op: str, loc: str, peer: int, size: int, role: str = "peer") -> None:
    if not isinstance(peer, int) or not 0 <= peer < size:
        raise CommError(
            f"{op} failed", loc, f"{role} {peer!r} is not a rank of this communicator",
            f"Use a rank in 0..{size - 1} of this communicator (not a global rank)",
        )


def check_p2p_kind(loc: str, kind: str) -> None:
    if kind not in ("send", "recv"):
        raise CommError(
            "batch_p2p failed", loc, f"P2POp kind {kind!r} is neither 'send' nor 'recv'",
            "Build each P2POp with kind='send' or kind='recv'",
        )


def check_split(loc: str, color: int, key: int) -> None:
    if not isinstance(color, int) or color < 0 or not isinstance(key, int):
        raise CommError(
            "split failed", loc,
            f"color {color!r} / key {key!r} are not a color >= 0 and an int key",
            "Pass the group index as color and the rank within the group as key",
        )


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when the memory spans of two tensors intersect (a collective's input and output)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def is_own_block(out: torch.Tensor, inp: torch.Tensor, rank: int) -> bool:
    """True when ``inp`` is exactly block ``rank`` of a contiguous ``out`` (in-place gather)."""
    return (
        inp.numel() > 0 and out.is_contiguous() and inp.is_contiguous()
        and out.dtype == inp.dtype and out.device == inp.device
        and inp.data_ptr() == out.data_ptr() + rank * inp.numel() * inp.element_size()
    )


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    extent = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True)) + 1
    return start, start + extent * t.element_size()


def _rows(t: torch.Tensor) -> int:
    # A 0-d tensor counts as one row so that scalars gather into a vector.
    return t.shape[0] if t.dim() else 1
