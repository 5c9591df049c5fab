"""Which failures restart the job, how many times, and how long to wait first (pure).

Never restarted: a round in which every rank exited 0; the head interrupted (Ctrl-C, SIGTERM,
SIGHUP: the user or the scheduler wants the job to stop); `--timeout` (the time is up, a
restart cannot help); and exit codes declared permanent by `--no-restart-on` (default 2, the
trainer's and argparse's code for bad input: a wrong flag fails the same way every time).
Everything else (a rank's non-zero exit or signal, a lost host, a hang under `--hang-action
abort`, an MPI_Abort with another code) restarts while the budget `--max-restarts` lasts.

The wait before restart k (1, 2, ...) is `--restart-backoff` x 2^(k-1), capped at
`BACKOFF_CAP_S` (or the base itself when that is larger): a failure that repeats at once (a
switch rebooting, a shared filesystem away) gets room, a single one costs one base wait.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

#: The longest wait between two rounds, unless --restart-backoff itself is longer.
BACKOFF_CAP_S = 60.0
#: The default of --no-restart-on: bad input (the trainer's and argparse's exit code).
PERMANENT_CODES = frozenset({2})


@dataclass(frozen=True)
class RestartOptions:
    """How a job survives failures (`dtrain launch` options of the same names)."""

    max_restarts: int = 0
    """--max-restarts: rounds after the first (0: the first failure ends the job)."""
    backoff: float = 1.0
    """--restart-backoff: seconds before the first restart; doubled for each further one."""
    no_restart_on: frozenset[int] = field(default_factory=lambda: PERMANENT_CODES)
    """--no-restart-on: exit codes that end the job at once (permanent failures)."""
    spares: int = 0
    """--spares: the last K hosts of the host list are spares (besides `spare` hostfile marks)."""
    min_nodes: int | None = None
    """--min-nodes: without a spare, go on with fewer hosts while at least this many remain."""
    restart_check: bool = False
    """--restart-check: run the `dtrain check` probes on a replacement host before using it."""
    exclude_after: int = 2
    """--exclude-after: blames that take a host out of the job for good (0: never)."""

    @property
    def enabled(self) -> bool:
        return self.max_restarts > 0


@dataclass(frozen=True)
class RoundEnd:
    """How one round ended, as far as the policy cares (from `launcher.head.outcome`)."""

    exit_code: int
    interrupted_by: int | None = None
    timed_out: bool = False


@dataclass(frozen=True)
class Decision:
    restart: bool
    why: str
    """Why not, when the job ends here (one clause, e.g. "exit code 2 is permanent")."""


def decide(end: RoundEnd, opts: RestartOptions, restarts_done: int) -> Decision:
    """Restart after this round, or end the job (first match wins, as the docstring says)."""
    if end.interrupted_by is not None:
        return Decision(False, f"interrupted by {_signal_name(end.interrupted_by)}")
    if end.timed_out:
        return Decision(False, "stopped by --timeout")
    if end.exit_code == 0:
        return Decision(False, "every rank exited 0")
    if end.exit_code in opts.no_restart_on:
        return Decision(False, f"exit code {end.exit_code} is permanent (--no-restart-on "
                               f"{','.join(map(str, sorted(opts.no_restart_on)))})")
    if restarts_done >= opts.max_restarts:
        return Decision(False, f"the restart budget is spent ({restarts_done} of "
                               f"--max-restarts {opts.max_restarts})")
    return Decision(True, "")


def backoff(opts: RestartOptions, restart: int) -> float:
    """Seconds to wait before restart number ``restart`` (1 for the first)."""
    if opts.backoff <= 0:
        return 0.0
    return float(min(opts.backoff * 2.0 ** (restart - 1), max(BACKOFF_CAP_S, opts.backoff)))


def parse_codes(text: str) -> frozenset[int]:
    """`--no-restart-on 2,3` -> {2, 3}; "" or "none" -> {} (every failure restarts)."""
    if text.strip().lower() in ("", "none"):
        return frozenset()
    codes = set()
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit() or not 1 <= int(item) <= 255:
            raise ValueError(f"{item!r} is not an exit code (1..255)")
        codes.add(int(item))
    return frozenset(codes)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
