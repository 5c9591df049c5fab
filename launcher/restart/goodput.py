"""Per-round accounting and the goodput report (pure).

Every round of a job gets a `RoundRecord` on the head's clock: when its start-up began, when
every rank was running, the first and last training step its ranks completed (from their
progress records: `launcher.head.progress.RoundSteps`), and for a failed round when the
failure happened (as well as the head can tell: a rank's exit at once, a silent host at its
last word, a hang when its ranks stopped advancing), when the head noticed it, and when every
rank of the round was gone. The report has one row per failure:

    detect    the failure until the head noticed it
    stop      until every rank of the round was gone
    restart   until every rank of the next round was running (back-off, connections, spawn)
    resume    until every rank of the next round had completed a step (the program's own
              start-up: imports, wire-up, loading the checkpoint)
    repeated  steps the failed round completed after the checkpoint the next one resumed from

Goodput = the time spent on steps that were kept / the job's wall time. A round keeps its steps
up to where the next round resumed (all of them in the last round); a step's time is the
round's average between its first and last completed step. Programs that write no progress
record (anything but the trainer) have no steps: their goodput is not known.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RoundRecord:
    number: int
    hosts: tuple[str, ...]
    started_at: float
    """The round's start-up began (SPEC sent)."""
    running_at: float | None = None
    """Every rank of the round was running."""
    first_step: int | None = None
    """The first step the round's ranks completed (the resumed checkpoint's step + 1)."""
    trained_at: float | None = None
    """Every rank had completed its first step of the round."""
    last_step: int | None = None
    """The furthest step a rank of the round completed."""
    last_step_at: float | None = None
    failed_at: float | None = None
    detected_at: float | None = None
    stopped_at: float | None = None
    exit_code: int = 0
    cause: str = ""
    blamed: tuple[str, ...] = ()
    detail: str = ""
    change: str = ""
    """What the next round does differently (a spare in a host's place, fewer hosts)."""


@dataclass(frozen=True)
class Row:
    round: int
    cause: str
    blamed: tuple[str, ...]
    exit_code: int
    detect_s: float | None
    stop_s: float | None
    restart_s: float | None
    resume_s: float | None
    steps_repeated: int | None
    change: str


@dataclass(frozen=True)
class Report:
    rows: tuple[Row, ...]
    wall_s: float
    kept_s: float | None
    goodput: float | None
    rounds: int
    details: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "restarts": self.rounds - 1, "wall_s": _r(self.wall_s),
                "kept_s": _r(self.kept_s), "goodput": _r(self.goodput, 4),
                "failures": [{k: _r(v) if isinstance(v, float) else v
                              for k, v in asdict(row).items()} for row in self.rows],
                "details": list(self.details)}


def report(records: Sequence[RoundRecord], wall_s: float) -> Report:
    rows = []
    for record, after in zip(records, [*records[1:], None], strict=True):
        if not record.exit_code:
            continue
        rows.append(Row(
            record.number, record.cause or "failure", record.blamed, record.exit_code,
            _span(record.failed_at, record.detected_at),
            _span(record.detected_at, record.stopped_at),
            _span(record.stopped_at, after.running_at if after else None),
            _span(after.running_at, after.trained_at) if after else None,
            _repeated(record, after), record.change))
    kept = _kept_seconds(records)
    return Report(tuple(rows), wall_s, kept, kept / wall_s if kept is not None and wall_s > 0
                  else None, len(records),
                  tuple(f"round {r.number}: {r.detail}" for r in records if r.detail))


def _repeated(record: RoundRecord, after: RoundRecord | None) -> int | None:
    if after is None or after.first_step is None or record.last_step is None:
        return None
    return max(0, record.last_step - (after.first_step - 1))


def _kept_seconds(records: Sequence[RoundRecord]) -> float | None:
    total, known = 0.0, False
    for record, after in zip(records, [*records[1:], None], strict=True):
        first, last = record.first_step, record.last_step
        if first is None or last is None or record.trained_at is None:
            continue
        known = True
        end = last if after is None or after.first_step is None else min(last,
                                                                           after.first_step - 1)
        if last > first and record.last_step_at is not None:
            per_step = (record.last_step_at - record.trained_at) / (last - first)
            total += max(0, end - first + 1) * per_step
    return total if known else None


def render(rep: Report) -> list[str]:
    """The table printed at the end of a job that restarted (without the ``dtrain: `` prefix)."""
    lines = []
    if rep.rows:
        head = ("round", "cause", "blamed", "code", "detect", "stop", "restart", "resume",
                "repeated", "next round")
        cells = [head] + [(str(r.round), r.cause, ",".join(r.blamed) or "-", str(r.exit_code),
                           _s(r.detect_s), _s(r.stop_s), _s(r.restart_s), _s(r.resume_s),
                           "-" if r.steps_repeated is None else str(r.steps_repeated),
                           r.change or "-") for r in rep.rows]
        widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                  for row in cells]
    restarts = rep.rounds - 1
    summary = f"{restarts} restart{'s' if restarts != 1 else ''}, wall {rep.wall_s:.1f}s"
    if rep.goodput is not None and rep.kept_s is not None:
        summary = (f"goodput {100 * rep.goodput:.1f}% ({rep.kept_s:.1f}s on kept steps of "
                   f"{rep.wall_s:.1f}s wall), {restarts} restart{'s' if restarts != 1 else ''}")
    return [*lines, summary]


def dumps(rep: Report) -> str:
    return json.dumps(rep.to_json(), indent=1) + "\n"


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else max(0.0, end - start)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def _r(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)
