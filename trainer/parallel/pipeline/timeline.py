"""When each pipeline action ran: recording, gathering, Chrome trace, Gantt chart, bubble.

Every rank records its own events (`Timeline.record`) in seconds since a common start: the
runtime takes ``t0`` right after a barrier on the PP communicator, so clocks line up to the
barrier's release skew (microseconds on one host; on several hosts still well under one
compute step). `gather` brings all ranks' events to every rank through the Communicator.

* `chrome_trace` / `write_chrome_trace`: the Trace Event Format JSON that chrome://tracing and
  ui.perfetto.dev open; one thread per rank, complete ("X") events in microseconds.
* `write_gantt`: a PNG (matplotlib, Agg backend) with one row per rank, forward and backward in
  different colours (chunk 1 darker than chunk 0), p2p waits as thin grey bars, idle left blank.
* `bubble`: idle time per rank = the step's span minus the rank's F and B time; waiting inside
  p2p counts as idle (the rank has nothing it could compute).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.comm.protocol import Communicator

COMPUTE = ("F", "B")


@dataclass(frozen=True)
class Event:
    """One action on one rank; times in seconds from the step's common start."""

    rank: int
    kind: str           # "F", "B" or "P2P"
    microbatch: int     # -1 for a p2p batch
    chunk: int
    start: float
    end: float
    label: str = ""

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    """The events of one rank, in the order they ran."""

    rank: int
    events: list[Event] = field(default_factory=list)

    def record(self, kind: str, microbatch: int, chunk: int, start: float, end: float,
               label: str = "") -> None:
        self.events.append(Event(self.rank, kind, microbatch, chunk, start, end, label))


def gather(comm: Communicator, timeline: Timeline, device: torch.device | str = "cpu"
           ) -> list[Event]:
    """Every rank's events, on every rank (collective over ``comm``): JSON bytes of different
    lengths, padded to the longest and all-gathered."""
    payload = json.dumps([asdict(e) for e in timeline.events]).encode()
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    lengths = torch.empty(comm.size, dtype=torch.int64, device=device)
    comm.all_gather(lengths, length)
    longest = int(lengths.max())
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    every = torch.empty(comm.size * longest, dtype=torch.uint8, device=device)
    comm.all_gather(every, mine.to(device))
    blocks = every.cpu().view(comm.size, longest)
    events: list[Event] = []
    for r in range(comm.size):
        raw = bytes(blocks[r, : int(lengths[r])].tolist())
        events += [Event(**e) for e in json.loads(raw)]
    return events


# -- bubble ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bubble:
    """Idle time of a step, per rank: ``idle / busy`` (what the (p-1)/m formulas give) and
    ``idle / span`` (the share of the step a rank spends idle)."""

    span: float
    busy: tuple[float, ...]
    idle_over_busy: tuple[float, ...]
    idle_over_span: tuple[float, ...]

    @property
    def mean_idle_over_busy(self) -> float:
        return sum(self.idle_over_busy) / len(self.idle_over_busy)

    @property
    def mean_idle_over_span(self) -> float:
        return sum(self.idle_over_span) / len(self.idle_over_span)


def bubble(events: Sequence[Event], p: int) -> Bubble:
    """The step spans from the first event's start to the last event's end, on any rank."""
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = [0.0] * p
    for e in events:
        if e.kind in COMPUTE:
            busy[e.rank] += e.duration
    idle = [span - b for b in busy]
    over_busy = tuple(i / b if b else 0.0 for i, b in zip(idle, busy, strict=True))
    return Bubble(span, tuple(busy), over_busy, tuple(i / span if span else 0.0 for i in idle))


def theory(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Bubble time over ideal compute time: (p-1)/m, or (p-1)/(v*m) interleaved (Narayanan et
    al. 2021). As a share of the whole step it is ``x / (1 + x)``."""
    return (p - 1) / (m * (v if schedule == "interleaved" else 1))


# -- Chrome trace / Perfetto ----------------------------------------------------------------


def chrome_trace(events: Sequence[Event], *, title: str = "pipeline") -> dict[str, Any]:
    """Trace Event Format: one process, one thread per rank, ``X`` events in microseconds."""
    ranks = sorted({e.rank for e in events})
    trace: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": title}}]
    for r in ranks:
        trace.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": r,
                      "args": {"name": f"rank {r}"}})
        trace.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": r,
                      "args": {"sort_index": r}})
    for e in events:
        name = e.label or (f"{e.kind}{e.microbatch}" + (f".c{e.chunk}" if e.chunk else ""))
        trace.append({"ph": "X", "name": name, "cat": e.kind, "pid": 0, "tid": e.rank,
                      "ts": round(e.start * 1e6, 3), "dur": round(e.duration * 1e6, 3),
                      "args": {"microbatch": e.microbatch, "chunk": e.chunk}})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | Path, events: Sequence[Event], *, title: str = "pipeline"
                       ) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(events, title=title)))
    return path


# -- Gantt chart ----------------------------------------------------------------------------

_COLOURS = {"F": ("#9ecae1", "#3182bd", "#08519c"), "B": ("#fdae6b", "#e6550d", "#a63603")}


def write_gantt(path: str | Path, events: Sequence[Event], *, title: str = "",
                panels: Sequence[tuple[str, Sequence[Event]]] = ()) -> Path:
    """A PNG Gantt chart: one row per rank (rank 0 on top), time in ms on x. ``panels`` draws
    several schedules stacked on a shared time axis instead of just ``events``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    panels = list(panels) or [(title, events)]
    rows = sum(len({e.rank for e in evs}) for _, evs in panels)
    fig, axes = plt.subplots(len(panels), 1, squeeze=False, sharex=True,
                             figsize=(12, 0.55 * rows + 1.1 * len(panels) + 0.6))
    for ax, (name, evs) in zip(axes[:, 0], panels, strict=True):
        _draw(ax, evs, name)
    axes[-1, 0].set_xlabel("time (ms)")
    legend = [Patch(color=_COLOURS["F"][1], label="forward"),
              Patch(color=_COLOURS["B"][1], label="backward")]
    if any(e.chunk > 0 for _, evs in panels for e in evs if e.kind in COMPUTE):
        legend += [Patch(color=_COLOURS["F"][2], label="forward, chunk 1"),
                   Patch(color=_COLOURS["B"][2], label="backward, chunk 1")]
    legend += [Patch(color="#bdbdbd", label="p2p (waiting)"),
               Patch(facecolor="white", edgecolor="#999", label="idle")]
    fig.legend(handles=legend, loc="upper right", ncol=len(legend), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _draw(ax: Any, events: Sequence[Event], name: str) -> None:
    p = max(e.rank for e in events) + 1
    t0 = min(e.start for e in events)
    for e in events:
        y = p - 1 - e.rank
        x, w = (e.start - t0) * 1e3, e.duration * 1e3
        if e.kind in COMPUTE:
            colour = _COLOURS[e.kind][(e.chunk + 1) % 3]  # chunk 0 mid, chunk 1 dark
            ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolors=colour, edgecolor="white",
                           linewidth=0.4)
            if w > 0:
                ax.text(x + w / 2, y, str(e.microbatch), ha="center", va="center", fontsize=6,
                        color="white", clip_on=True)
        else:
            ax.broken_barh([(x, w)], (y - 0.08, 0.16), facecolors="#bdbdbd")
    stats = bubble(events, p)
    ax.set_title(f"{name}   measured bubble {stats.mean_idle_over_busy:.1%} of compute "
                 f"({stats.mean_idle_over_span:.1%} of the step)", fontsize=9, loc="left")
    ax.set_yticks(range(p), [f"rank {p - 1 - y}" for y in range(p)], fontsize=8)
    ax.set_ylim(-0.6, p - 0.4)
    ax.grid(axis="x", alpha=0.3)
