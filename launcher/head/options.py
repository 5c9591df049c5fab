"""How the head supervises a job: heartbeats, grace, timeouts, PMI (a light module: the CLI
builds it before anything heavy is imported)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SuperviseOptions:
    heartbeat: float = 5.0          # seconds between heartbeats, both directions
    misses: int = 3                 # silent intervals before a host counts as lost
    grace: float = 10.0             # SIGTERM -> SIGKILL delay when stopping ranks
    timeout: float | None = None    # whole-job limit (--timeout)
    launch_timeout: float = 120.0   # connect-to-all-running limit
    pmi: str = "fd"                 # fd, port or off
    pmi_stall: float = 30.0         # name the ranks a PMI barrier waits for after this long
    hang_timeout: float = 1800.0    # diagnose a job whose records stood still this long (0: off)
    hang_action: str = "report"     # report (and keep waiting) or abort (exit 123)
    status_interval: float = 0.0    # print the live progress table this often (0: never)
    rounds: bool = False            # agents stay after their ranks exit: a round may follow
