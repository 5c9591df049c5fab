"""The head's side of progress records: hang diagnosis, live view, stragglers.

The agents send their ranks' views every `sample_interval` seconds (PROGRESS frames). When the
`HangClock` says the job is hung (no record advanced for ``--hang-timeout`` seconds while ranks
wait), the head sends every agent a PROBE naming the ranks a first diagnosis blames (the agents
answer with fresh records and those ranks' py-spy stacks), waits up to `PROBE_WAIT_S` for the
answers, prints the diagnosis (`launcher.hang.diagnose`) and writes it to
``<log dir>/hang-<n>.txt``; with ``--hang-action abort`` the supervisor then stops the job with
exit code `HANG_CODE`. ``--status-interval`` prints the live table (`launcher.hang.status`);
stragglers (`launcher.hang.watch`) are named in it and once more at the end of the run.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.hang import mpi
from launcher.hang.diagnose import Diagnosis, diagnose
from launcher.hang.views import RankView
from launcher.hang.watch import HangClock, stragglers
from launcher.head.options import SuperviseOptions
from records import replace

HANG_CODE = 123          # exit code of a job ended by --hang-action abort
PROBE_WAIT_S = 15.0      # how long the head waits for the agents' stacks
MAX_STACKS = 8           # stacks asked for when no rank is to blame (every rank waits)
#: How often the head looks for MPI ranks fenced too long (`mpi.suspects`: a pass over every
#: rank's view). Each view's fence age is as old as the view (`sample_interval`), and the timeout
#: is seconds to minutes; at every 0.1 s tick the pass was the head's largest cost at 1,024
#: hosts x 8 ranks (bench.sim_scale's profile).
SUSPECTS_EVERY_S = 1.0
#: PROGRESS frames a second the head takes by default (`sample_interval`): 256 hosts at one a
#: second each; a larger job's agents sample less often, unless --hang-timeout or
#: --status-interval asks for more.
PROGRESS_PER_S = 256.0


@dataclass(frozen=True)
class RoundSteps:
    """The training steps of one round as the records showed them, on the head's clock (the
    goodput report's input, `launcher.restart.goodput`); None where no rank reported a step."""

    first_step: int | None = None    # the first step a rank of the round completed
    trained_at: float | None = None  # every rank had completed its first step
    last_step: int | None = None     # the furthest step a rank completed
    last_step_at: float | None = None


def sample_interval(opts: SuperviseOptions, hosts: int = 1) -> float:
    """How often agents read the records: often enough to see a hang a fraction of its timeout
    after it starts, and the live view each time it is printed; otherwise once a second, or
    as often as keeps the head's share at `PROGRESS_PER_S` frames a second over ``hosts``
    hosts (each PROGRESS carries its host's every rank: decoding them was a fifth of the
    head's work at 1,024 hosts x 8 ranks, and the agents' own reading of the records a third
    of the simulated hosts', bench.sim_scale's profile)."""
    wanted = [max(1.0, hosts / PROGRESS_PER_S)]
    if opts.hang_timeout:
        wanted.append(opts.hang_timeout / 5)
    if opts.status_interval:
        wanted.append(opts.status_interval)
    return max(0.1, min(wanted))


class ProgressMonitor:
    def __init__(self, opts: SuperviseOptions, probe: Callable[[dict[str, Any]], None],
                 say: Callable[[str], None], log_dir: Path | None, now: float) -> None:
        self.opts, self._probe, self._say, self.log_dir = opts, probe, say, log_dir
        self.views: dict[int, RankView] = {}
        self.received: dict[int, float] = {}  # rank -> when its view arrived (head's clock)
        self._fresh: set[int] = set()  # ranks whose views arrived since the clock's last look
        # rank -> (steps, their compute seconds): the records' own average covers only the last
        # few steps, so the end-of-run verdict sums each view's average over the steps it saw.
        self._run_compute: dict[int, tuple[int, float]] = {}
        self.clock = HangClock(opts.hang_timeout, now) if opts.hang_timeout else None
        self.diagnoses: list[Diagnosis] = []
        self._probing: dict[str, Any] | None = None
        self._mpi_next = 0.0                     # when MPI ranks' stacks may be looked at again
        self._suspects_next = 0.0                # when to look for fenced ranks again
        self._mpi_told: tuple[int, ...] = ()     # the fenced ranks last diagnosed (told once)
        self._next_status = now + (opts.status_interval or 0.0)

    def on_progress(self, host: int, body: dict[str, Any]) -> None:
        now = time.monotonic()
        for raw in body.get("ranks", ()):
            view = RankView.from_json(raw)
            self._count_steps(view)
            self.views[view.rank] = view
            self.received[view.rank] = now
            self._fresh.add(view.rank)
        probing = self._probing
        if probing is not None and body.get("probe") == probing["id"]:
            probing["stacks"].update({int(r): s for r, s in (body.get("stacks") or {}).items()})
            probing["pending"].discard(host)

    def round_steps(self) -> RoundSteps:
        """First and last steps the views showed; ages are turned into the head's clock with
        the time each view arrived (the agents' clocks never meet the head's)."""
        stepped = [v for v in self.views.values() if v.first_step and v.first_step_age is not None]
        if not stepped:
            return RoundSteps()
        last = max(stepped, key=lambda v: v.step)
        return RoundSteps(
            min(v.first_step for v in stepped),
            max(self.received[v.rank] - (v.first_step_age or 0.0) for v in stepped),
            last.step, self.received[last.rank] - (last.step_age or 0.0))

    def _count_steps(self, view: RankView) -> None:
        last = self.views.get(view.rank)
        new = view.step - (last.step if last is not None else 0)
        if new > 0 and view.compute_avg_s > 0:
            steps, total = self._run_compute.get(view.rank, (0, 0.0))
            self._run_compute[view.rank] = (steps + new, total + new * view.compute_avg_s)

    def tick(self, now: float, hosts: set[int]) -> Diagnosis | None:
        """Timers of the supervisor loop; ``hosts`` are the agents still connected. Returns a
        diagnosis when one was just made (the supervisor applies --hang-action)."""
        if self.opts.status_interval and now >= self._next_status:
            self._next_status = now + self.opts.status_interval
            self.print_status()
        if self.clock is None:
            return None
        self.clock.update(self.views, now, self._fresh)
        if self._probing is not None:
            if self._probing["pending"] & hosts and now < self._probing["until"]:
                return None
            return self._conclude(now)
        if self.clock.due(self.views, now):
            self.clock.fired = True
            blamed = diagnose(list(self.views.values())).culprit_ranks or tuple(
                sorted(self.views))[:MAX_STACKS]
            self._start_probe(now, hosts, blamed, self.clock.stalled_for(now))
            return None
        if now < max(self._mpi_next, self._suspects_next):
            return None
        self._suspects_next = now + SUSPECTS_EVERY_S
        fenced, others = mpi.suspects(self.views.values(), self.opts.hang_timeout)
        if fenced and tuple(fenced) != self._mpi_told:
            # An MPI program: a rank in MPI_Finalize for the timeout while others run. Their
            # native stacks tell whether they wait in MPI (a hang) or compute (none yet).
            self._mpi_next = now + self.opts.hang_timeout
            stalled = max(self.views[r].fence_age or 0.0 for r in fenced)
            self._start_probe(now, hosts, others[:MAX_STACKS], stalled, native=tuple(fenced))
        return None

    def _start_probe(self, now: float, hosts: set[int], ranks: Sequence[int], stalled: float,
                     native: tuple[int, ...] = ()) -> None:
        self._probing = {"id": len(self.diagnoses) + 1, "pending": set(hosts),
                         "until": now + PROBE_WAIT_S, "stacks": {}, "stalled": stalled,
                         "fenced": native}
        self._probe({"probe": self._probing["id"], "stacks": list(ranks),
                     "native": bool(native)})

    def _conclude(self, now: float) -> Diagnosis | None:
        probing, self._probing = self._probing or {}, None
        views: list[RankView] | None = list(self.views.values())
        if probing.get("fenced"):
            views = mpi.views(self.views, probing["stacks"], self.opts.hang_timeout)
            if views is None:
                return None  # the others compute: asked again after another timeout
            self._mpi_told = probing["fenced"]
        found = diagnose(views or [], probing.get("stacks"))
        head = (f"hang: no rank made progress for {probing.get('stalled', 0.0):.1f}s "
                f"(--hang-timeout {self.opts.hang_timeout:g}); cause: {found.headline}")
        self.diagnoses.append(found)
        text = "\n".join((head, *found.lines))
        where = self._write(text, len(self.diagnoses))
        for line in text.splitlines():
            self._say(line)
        if where:
            self._say(f"hang diagnosis written to {where}")
        return found

    def _write(self, text: str, n: int) -> Path | None:
        if self.log_dir is None:
            return None
        path = self.log_dir / f"hang-{n}.txt"
        try:
            path.write_text(text + "\n")
        except OSError as exc:
            self._say(f"warning: cannot write {path}: {exc.strerror}")
            return None
        return path

    def print_status(self) -> None:
        from launcher.hang.status import render

        if not self.views:
            return
        width = shutil.get_terminal_size().columns - len("dtrain: ")
        for line in render(self.views, stragglers(self.views), width):
            self._say(line)

    def final_report(self) -> list[str]:
        """Stragglers over the whole run (printed after the job): each rank's compute time per
        step averaged over every step the views covered, not only the last record's few."""
        slow = stragglers({r: self._whole_run(v) for r, v in self.views.items()})
        return [f"straggler: {s.describe()}" for s in slow]

    def _whole_run(self, view: RankView) -> RankView:
        steps, total = self._run_compute.get(view.rank, (0, 0.0))
        return replace(view, compute_avg_s=total / steps) if steps else view
