"""A failed rank's root-cause error, from the file torch's ``@record`` writes (pure).

torch.distributed.elastic's ``@record`` decorator writes the exception that ended a rank's
entry point into the file named by ``TORCHELASTIC_ERROR_FILE`` (JSON: ``{"message":
{"message": "Type: text", "extraInfo": {"py_callstack": traceback, "timestamp": s}}}``; older
writers put a plain string in ``message``). torchrun gives each rank its own file and reports
the first failure's (its ChildFailedError). dtrain does the same: the agent names one file per
rank in the job's private folder on its host (`launcher.agent.progress`, removed with the job),
reads it when the rank exits with a failure and sends what `parse` found in the EXIT frame; the
head shows it in the failure summary, else the rank's last stderr lines.

The file is written by the user's program: it is read with a size bound, never followed
through a link, parsed as JSON only, and its text is shown with control characters escaped.
"""

from __future__ import annotations

from records import Record

TYPE_CHECKING = False  # importing `typing` costs every agent's start-up; mypy reads True
if TYPE_CHECKING:
    from typing import Any

VARIABLE = "TORCHELASTIC_ERROR_FILE"
MAX_BYTES = 1 << 20        # a deep traceback is tens of KiB; more is not a record
MAX_TRACEBACK_LINES = 60   # the last ones: where it was raised


class RootCause(Record, frozen=True):
    """What a rank's error file says: the exception and where it was raised."""

    #: ``ValueError: text``, as torch writes it (type name, colon, message).
    message: str
    #: The Python traceback, its last `MAX_TRACEBACK_LINES` lines ("" when none was written).
    traceback: str = ""

    def to_json(self) -> dict[str, str]:
        return {"message": self.message, "traceback": self.traceback}

    @classmethod
    def from_json(cls, body: Any) -> RootCause | None:
        if not isinstance(body, dict) or not isinstance(body.get("message"), str):
            return None
        tb = body.get("traceback")
        return cls(_printable(body["message"]), _printable(tb if isinstance(tb, str) else "",
                                                           keep_newlines=True))

    def lines(self) -> list[str]:
        """The traceback, else the message alone."""
        return self.traceback.rstrip("\n").splitlines() or [self.message]


def path(folder: str, rank: int) -> str:
    return f"{folder}/rank-{rank}.error.json"


def parse(data: bytes) -> RootCause | None:
    """The root cause in an error file's bytes; None when they hold none (empty, not JSON,
    another shape)."""
    import json

    try:
        body = json.loads(data.decode("utf-8", errors="replace"))
    except ValueError:
        return None
    message = body.get("message") if isinstance(body, dict) else None
    if isinstance(message, str):
        return RootCause(_printable(message))
    if not isinstance(message, dict) or not isinstance(message.get("message"), str):
        return None
    extra = message.get("extraInfo")
    tb = extra.get("py_callstack") if isinstance(extra, dict) else None
    lines = tb.splitlines()[-MAX_TRACEBACK_LINES:] if isinstance(tb, str) else []
    return RootCause(_printable(message["message"]),
                     _printable("\n".join(lines), keep_newlines=True))


def read(file: str) -> RootCause | None:
    """The root cause in ``file``; None when there is none or it cannot be read (a link, not a
    regular file, too large: the rank's program is not trusted to write a proper one)."""
    import os
    import stat

    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_BYTES:
            return None
        with os.fdopen(fd, "rb") as f:
            fd = -1
            return parse(f.read(MAX_BYTES))
    except OSError:
        return None
    finally:
        if fd >= 0:
            os.close(fd)


def _printable(text: str, keep_newlines: bool = False) -> str:
    """Control characters escaped (a terminal must not act on what a rank wrote)."""
    keep = "\n" if keep_newlines else ""
    return "".join(c if c.isprintable() or c in keep else
                   ("    " if c == "\t" else repr(c)[1:-1]) for c in text)
