"""Pipeline schedules as per-rank action lists (pure: no torch, no communication).

A pipeline of ``p`` ranks runs ``m`` microbatches through ``S = v * p`` stages. With ``v > 1``
(interleaved) every rank holds ``v`` model chunks and **chunk c of rank r is stage c*p + r**
(Megatron's virtual pipeline placement), so stage ``s`` lives on rank ``s % p`` as chunk
``s // p``, and activations go round the ring of ranks ``v`` times.

A schedule is ``p`` lists of `Action`s (see `trainer.parallel.pipeline.actions`), one per rank,
run in
order: ``F``/``B`` (forward/backward of one microbatch on one chunk) and the p2p actions
``RECV_F``/``SEND_F`` (activations) and ``RECV_B``/``SEND_B`` (gradients). Consecutive p2p
actions form one batch, posted together with ``Communicator.batch_p2p``.

The builders here decide only the order of compute on each rank, which is what distinguishes
GPipe, 1F1B and interleaved 1F1B, as *slots* (Megatron's steps: one F or B; in the steady state
of interleaved 1F1B an (F, B) pair). `trainer.parallel.pipeline.placement` then inserts the p2p
actions
between slots, and `trainer.parallel.pipeline.check` verifies the result without running anything.
"""

from __future__ import annotations

from trainer.parallel.pipeline.actions import (  # noqa: F401 - re-exported: the schedule vocabulary
    Action,
    Kind,
    Schedule,
    ScheduleError,
    batches,
    place,
    stage_of,
)
from trainer.parallel.pipeline.placement import place_p2p


def _check_sizes(name: str, p: int, m: int, v: int = 1) -> None:
    for label, value in (("p", p), ("m", m), ("v", v)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(
                f"cannot build the {name} schedule", f"{label}={value!r}",
                f"{label} must be a positive integer (p pipeline ranks, m microbatches, "
                "v chunks per rank)", f"Pass {label} >= 1")


def _f(mb: int, chunk: int = 0) -> Action:
    return Action(Kind.F, mb, chunk)


def _b(mb: int, chunk: int = 0) -> Action:
    return Action(Kind.B, mb, chunk)


def gpipe(p: int, m: int) -> Schedule:
    """GPipe (fill-drain): every forward, then every backward; m activations in flight."""
    _check_sizes("GPipe", p, m)
    slots = [[_f(i)] for i in range(m)] + [[_b(i)] for i in range(m)]
    return place_p2p([slots] * p, p, 1)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush, Megatron's non-interleaved schedule): ``min(p-rank-1, m)`` warm-up
    forwards, then one forward / one backward, then the remaining backwards. A rank holds at most
    ``p - rank`` microbatches' activations instead of GPipe's m."""
    _check_sizes("1F1B", p, m)
    per_rank = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        slots = [[_f(i)] for i in range(warmup)]
        for i in range(m - warmup):
            slots += [[_f(warmup + i)], [_b(i)]]
        slots += [[_b(i)] for i in range(m - warmup, m)]
        per_rank.append(slots)
    return place_p2p(per_rank, p, 1)


def check_interleaving(p: int, m: int, v: int, group: int | None = None) -> int:
    """Megatron's constraints on interleaved 1F1B; returns the microbatch group size g."""
    _check_sizes("interleaved 1F1B", p, m, v)
    where = f"p={p}, m={m}, v={v}"
    if p < 2:
        raise ScheduleError(
            "cannot interleave a pipeline of one rank", where,
            "interleaving passes activations round a ring of at least 2 ranks",
            "Use one_f_one_b (or gpipe) for p=1, or raise the pipeline size")
    g = p if group is None else group
    if not p <= g <= m:
        raise ScheduleError(
            "cannot build the interleaved 1F1B schedule", f"{where}, group={g}",
            f"the microbatch group size g must satisfy p <= g <= m ({p} <= {g} <= {m} is "
            "false; g defaults to p, Megatron's microbatch_group_size_per_vp_stage)",
            f"Use at least {max(p, g)} microbatches per step"
            + ("" if g >= p else f", or a group size of at least p={p}"))
    if m % g and m % g < p:
        fit = ", ".join(str(x) for x in _fitting(p, g, m))
        raise ScheduleError(
            "cannot build the interleaved 1F1B schedule", f"{where}, group={g}",
            f"m % g = {m % g} is neither 0 nor >= p, so the last microbatch group is too short "
            "to cover the pipeline and introduces dependency bubbles",
            f"Use a number of microbatches that fits, e.g. {fit}")
    return g


def _fitting(p: int, g: int, m: int) -> list[int]:
    """The two nearest microbatch counts around m that satisfy the group rule."""
    ok = [x for x in range(g, m + 2 * g + 1) if x % g == 0 or x % g >= p]
    below = [x for x in ok if x < m][-1:]
    above = [x for x in ok if x > m][:1]
    return below + above


def schedule_table(m: int, v: int, g: int) -> list[tuple[int, int]]:
    """Megatron's ``get_schedule_table``: the forward order of (microbatch, chunk) on every rank:
    groups of g microbatches (the last group takes the rest), each group run chunk by chunk."""
    table: list[tuple[int, int]] = []
    for first in range(0, m, g):
        end = m if first + g >= m else first + g
        table += [(mb, c) for c in range(v) for mb in range(first, end)]
    return table


def interleaved_warmup(p: int, rank: int, m: int, v: int, g: int) -> int:
    """Megatron's warm-up: ``(p - rank - 1) * 2 + (v - 1) * g`` forwards, capped at m*v."""
    return min((p - rank - 1) * 2 + (v - 1) * g, m * v)


def interleaved(p: int, m: int, v: int, group: int | None = None) -> Schedule:
    """Interleaved 1F1B (Megatron's virtual pipeline): v chunks per rank, forwards in
    `schedule_table` order, backwards in the same order with chunks reversed. The bubble shrinks
    to (p-1)/(v*m) of the compute at the cost of v times more p2p messages."""
    g = check_interleaving(p, m, v, group)
    table = schedule_table(m, v, g)
    fwd = [_f(mb, c) for mb, c in table]
    bwd = [_b(mb, v - 1 - c) for mb, c in table]
    total = m * v
    per_rank = []
    for r in range(p):
        warmup = interleaved_warmup(p, r, m, v, g)
        slots = [[f] for f in fwd[:warmup]]
        slots += [[fwd[warmup + k], bwd[k]] for k in range(total - warmup)]
        slots += [[b] for b in bwd[total - warmup:]]
        per_rank.append(slots)
    return place_p2p(per_rank, p, v)


def build(name: str, p: int, m: int, v: int = 1, group: int | None = None) -> Schedule:
    """A schedule by name: ``gpipe``, ``1f1b`` or ``interleaved`` (which uses v and group)."""
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name == "interleaved":
        return interleaved(p, m, v, group)
    raise ScheduleError("unknown pipeline schedule", f"schedule={name!r}",
                        "the schedules are gpipe, 1f1b and interleaved", "Pass one of them")


def chunks_of(name: str, v: int) -> int:
    """How many chunks per rank a schedule of that name runs (v only for interleaved)."""
    return v if name == "interleaved" else 1
