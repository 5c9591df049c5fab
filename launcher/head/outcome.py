"""How a job ended, and the exit-code rule of `dtrain launch` (pure; documented in
docs/launching/output-and-exit-codes.md).

Exit-code rule, first match wins:

1. the head was interrupted: 130 for Ctrl-C (SIGINT), 143 for SIGTERM, 129 for SIGHUP;
2. `--timeout` expired: 124;
3. a rank called MPI_Abort / PMI abort: the abort's exit code;
4. the first failure the head observed: a rank's exit code, or 128+N when signal N killed it;
   a rank that closed its PMI connection before finalize counts as 1 until its exit status
   arrives, which then replaces that inference when it is not 0 (the kernel closes a SIGKILLed
   rank's socket before the agent reaps it, so the close is usually seen first); a host lost
   (agent gone, heartbeat silence) is 255; a hang diagnosed under `--hang-action abort` is 123
   (`launcher.head.progress`);
5. otherwise 0.

Ranks stopped by dtrain because another rank failed are reported as "stopped", not as failures.
Each rank's status says who signalled it: its agent reports the signals it sent the rank, so
"killed by SIGKILL from dtrain, 10.0s after its SIGTERM" (the grace ran out) reads apart from a
SIGKILL dtrain did not send (the OOM killer), and "exit 143 after dtrain's SIGTERM" (a clean
stop, a checkpoint saved) from an exit on somebody else's SIGTERM.
"""

from __future__ import annotations

import signal as _signal
from dataclasses import dataclass, field

from launcher.errorfile import RootCause


@dataclass
class RankOutcome:
    rank: int
    host: str
    state: str = "pending"     # pending, running, exited, stopped, lost
    code: int | None = None
    signal: int | None = None
    pid: int | None = None
    #: What its error file says (torch's ``@record``), when it failed and wrote one.
    error: RootCause | None = None
    #: The signals dtrain (the rank's agent) sent it, each with its seconds after the first.
    sent: tuple[tuple[int, float], ...] = ()

    @property
    def failed(self) -> bool:
        return self.state == "exited" and self.code not in (0, None)

    def describe(self) -> str:
        if self.signal:
            return f"killed by {signal_name(self.signal)}{self._by_whom(self.signal)}"
        if self.code is None:
            return self.state
        if self.sent:
            return f"exit {self.code} after dtrain's {signal_name(self.sent[0][0])}"
        return f"exit {self.code}"

    def _by_whom(self, signum: int) -> str:
        after = dict(self.sent).get(signum)
        if after is None:  # a fault the program raised itself needs no word
            return "" if signum in _FAULTS else " (not sent by dtrain)"
        first = signal_name(self.sent[0][0])
        return f" from dtrain, {after:.1f}s after its {first}" if after else " from dtrain"


@dataclass
class Failure:
    code: int
    where: str   # "rank 3@node2" or "host node2"
    why: str
    #: The rank that failed, when the failure is one rank's.
    rank: int | None = None
    #: Inferred from the rank's closed PMI connection: its exit status, once known, is the truth.
    inferred: bool = False


@dataclass
class JobOutcome:
    ranks: dict[int, RankOutcome]
    interrupted_by: int | None = None
    timed_out: bool = False
    abort: Failure | None = None
    failures: list[Failure] = field(default_factory=list)

    def record_failure(self, failure: Failure) -> bool:
        """Record a failure; True when it is the first (the caller then stops the job)."""
        self.failures.append(failure)
        return len(self.failures) == 1 and self.abort is None

    def rank_exited(self, rank: int, code: int, signum: int | None, stopping: bool,
                    error: RootCause | None = None,
                    sent: tuple[tuple[int, float], ...] = ()) -> Failure | None:
        """Record a rank's exit status (what its error file says, and the signals dtrain
        ``sent`` it); returns the failure it is, if it is a new one.

        A rank already failed by inference (its PMI connection closed) keeps its place as the
        first failure, now with its real status; a rank dtrain was stopping is "stopped".
        """
        r = self.ranks[rank]
        r.code, r.signal, r.error, r.sent = code, signum, error, sent
        why = exit_status_why(code, signum) + (f" ({error.message})" if error else "")
        inferred = [i for i, f in enumerate(self.failures) if f.rank == rank and f.inferred]
        if inferred:
            r.state = "exited"
            if code != 0:
                self.failures[inferred[0]] = Failure(code, f"rank {rank}@{r.host}", why, rank)
            return None
        if stopping and code != 0:
            r.state = "stopped"  # we asked it to stop; not a failure of its own
            return None
        r.state = "exited"
        if code == 0:
            return None
        return Failure(code, f"rank {rank}@{r.host}", why, rank)

    @property
    def exit_code(self) -> int:
        if self.interrupted_by is not None:
            return 128 + self.interrupted_by
        if self.timed_out:
            return 124
        if self.abort is not None:
            return self.abort.code
        if self.failures:
            return self.failures[0].code
        return 0

    @property
    def summary(self) -> str:
        if self.interrupted_by is not None:
            return f"interrupted by {signal_name(self.interrupted_by)}"
        if self.timed_out:
            return "stopped by --timeout"
        if self.abort is not None:
            return f"aborted by {self.abort.where}: {self.abort.why}"
        if self.failures:
            f = self.failures[0]
            return f"first failure: {f.where}: {f.why}"
        return "all ranks exited 0"


#: Signals a program raises itself (a crash), not ones somebody sends it.
_FAULTS = frozenset({_signal.SIGSEGV, _signal.SIGBUS, _signal.SIGFPE, _signal.SIGILL,
                     _signal.SIGABRT, _signal.SIGTRAP, _signal.SIGSYS})


def signal_name(signum: int) -> str:
    try:
        return _signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_status_why(code: int, signum: int | None) -> str:
    """Human reason for a rank's status, with the usual hint for SIGKILL (often the OOM killer)."""
    if signum:
        hint = " (the kernel's OOM killer sends this too)" if signum == _signal.SIGKILL else ""
        return f"killed by {signal_name(signum)}{hint}"
    if 128 < code < 128 + _signal.NSIG and code - 128 not in _FAULTS:
        # How a program that handles a signal says it stopped for it (the trainer's SIGTERM
        # checkpoint: 143); a failure is a rank's own, so dtrain had sent it nothing.
        return f"exited with code {code} (128 + {signal_name(code - 128)}, not sent by dtrain)"
    return f"exited with code {code}"
