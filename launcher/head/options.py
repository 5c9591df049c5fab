"""How the head supervises a job: heartbeats, grace, timeouts, PMI (a light module: the CLI
builds it before anything heavy is imported). What the agents share with the head (heartbeat,
misses, grace, the PMI mode and stall time) takes its default from the SPEC's dataclasses in
`launcher.wire`, the one place those defaults are written; the command line reads them here."""

from __future__ import annotations

from dataclasses import dataclass

from launcher.wire import PmiSpec, Watch


@dataclass(frozen=True)
class SuperviseOptions:
    heartbeat: float = Watch.heartbeat  # seconds between heartbeats, both directions
    misses: int = Watch.misses          # silent intervals before a host counts as lost
    grace: float = Watch.grace          # SIGTERM -> SIGKILL delay when stopping ranks
    timeout: float | None = None        # whole-job limit (--timeout)
    launch_timeout: float = 120.0       # hosts coming up, then connect-to-all-running
    pmi: str = PmiSpec.mode             # fd, port or off
    pmi_stall: float = PmiSpec.stall    # name the ranks a PMI barrier waits for after this long
    hang_timeout: float = 1800.0        # diagnose records that stood still this long (0: off)
    hang_action: str = "report"         # report (and keep waiting) or abort (exit 123)
    status_interval: float = 0.0        # print the live progress table this often (0: never)
    rounds: bool = False                # agents stay after their ranks: a round may follow
    start: str = "together"             # together: ranks start once every host is READY;
                                        # eager: each host once it and rank 0's are READY

    @property
    def watch(self) -> Watch:
        """The liveness settings the SPEC hands to every agent."""
        return Watch(self.heartbeat, self.misses, self.grace)
