"""PMI-1 wire codec: split a byte stream into lines, parse a request, format a reply.

The grammar is MPICH's (``src/pmi/src/pmi_wire.c``, ``parse_v1``): a line is
``cmd=<name> key=value key=value ...`` terminated by ``\\n``; tokens are separated by spaces;
a key is made of letters, digits, ``_``, ``-`` and ``/`` (MPICH's own keys look like
``-allgather-1-0-seg-1/9``); a value runs to the next space and may contain any other byte,
``=`` included (``value=segments=9`` is a real put). A backslash escapes the next character,
which is how MPICH >= 4 writes a space inside a value; older clients (MPICH 3, Intel MPI) never
escape. ``cmd=abort`` is the one place clients send free text, so its ``message=`` takes the
rest of the line verbatim (MPICH itself sends ``message=abort``).

Spawn is the only multi-line request: a ``mcmd=spawn`` line followed by ``key=value`` lines
(values may hold spaces there) and one ``endcmd`` line per spawned command. The codec only
recognises it (``PmiCommand.multiline``) and tells where it ends (``SpawnBlock``) so the proxy
can swallow the block and refuse it.

Limits: a line may hold at most ``MAX_LINE`` bytes (MPICH's largest value, 1024, plus keys and
room to spare). ``LineBuffer`` enforces it on the unfinished line too, so a client that streams
bytes without a newline is cut off at 4 KiB instead of growing the agent's memory.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType

from launcher.errors import PmiError
from records import Record, field

MAX_LINE = 4096
# Scanned by the regular-expression engine, not character by character in Python: every
# rank's put of its business card (hundreds of bytes) is parsed by its agent, and the
# per-character loops were the largest part of a simulated host's work (`bench.sim_scale`).
_KEY = re.compile(r"[A-Za-z0-9_/-]*")  # letters and digits (ASCII only), _ - /
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class PmiProtocolError(PmiError):
    """A PMI client sent bytes that are not a PMI-1 request; its connection is closed."""

    def __init__(self, why: str, lines: tuple[bytes, ...] = ()) -> None:
        super().__init__(
            "PMI request rejected", "", why,
            "The process is not speaking PMI-1; check that it uses MPICH (or MVAPICH, "
            "Intel MPI) and that nothing else writes to its PMI_FD",
        )
        #: Lines completed before the offending bytes (``LineBuffer.feed`` only).
        self.lines = lines


class PmiCommand(Record, frozen=True):
    """One parsed request: ``cmd`` without the ``cmd=`` and the other attributes in order."""

    cmd: str
    attrs: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    multiline: bool = False  # the first line of an ``mcmd=`` block (spawn)

    def get(self, key: str) -> str | None:
        return self.attrs.get(key)

    def value(self, key: str, default: str = "") -> str:
        """The attribute's value, ``default`` when the command has none."""
        return self.attrs.get(key, default)


def _decode(line: bytes) -> str:
    if line.endswith(b"\n"):
        line = line[:-1]
    if len(line) > MAX_LINE:
        raise PmiProtocolError(f"line of {len(line)} bytes exceeds the {MAX_LINE}-byte limit")
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        raise PmiProtocolError("line is not UTF-8 text") from None
    bad = _CONTROL.search(text)
    if bad is not None:
        raise PmiProtocolError(f"line holds the control character {ord(bad.group()):#04x}")
    return text


def _read_key(text: str, pos: int) -> tuple[str, int]:
    start = pos
    found = _KEY.match(text, pos)  # `*`: always a match, maybe empty
    pos = found.end() if found else pos
    if pos == start:
        raise PmiProtocolError(f"expected a key at column {start + 1}, found {text[start]!r}")
    if pos < len(text) and text[pos] not in "= ":
        raise PmiProtocolError(f"invalid character {text[pos]!r} after key {text[start:pos]!r}")
    return text[start:pos], pos


def _read_value(text: str, pos: int, stop: str = " ") -> tuple[str, int]:
    """Read from ``pos`` to the next unescaped ``stop`` character, dropping escape backslashes
    (``stop=""`` reads to the end of the line)."""
    end = text.find(stop, pos) if stop else -1
    end = len(text) if end < 0 else end
    if text.find("\\", pos, end) < 0:  # no escape before the first stop: it ends the value
        return text[pos:end], end
    out: list[str] = []
    while pos < len(text) and text[pos] != stop:
        if text[pos] == "\\" and pos + 1 < len(text):
            pos += 1
        out.append(text[pos])
        pos += 1
    return "".join(out), pos


def _tokens(text: str, head: str) -> tuple[str, dict[str, str]]:
    """Parse ``head=<name> k=v ...``; the first occurrence of a repeated key wins (MPICH)."""
    name, pos = _read_value(text, len(head) + 1)
    if not name:
        raise PmiProtocolError(f"empty {head}= name")
    attrs: dict[str, str] = {}
    while True:
        while pos < len(text) and text[pos] == " ":
            pos += 1
        if pos >= len(text):
            return name, attrs
        key, pos = _read_key(text, pos)
        value = ""
        if pos < len(text) and text[pos] == "=":
            if name == "abort" and key in ("message", "error_msg"):
                value, pos = _read_value(text, pos + 1, stop="")
            else:
                value, pos = _read_value(text, pos + 1)
        attrs.setdefault(key, value)


def parse_line(line: bytes) -> PmiCommand:
    """Parse one request line (with or without its ``\\n``).

    Raises ``PmiProtocolError`` for anything that is not a PMI-1 request: not UTF-8, a control
    character, longer than ``MAX_LINE``, not starting with ``cmd=`` or ``mcmd=``, or a malformed
    key. A bare key (no ``=``) is kept with an empty value.
    """
    text = _decode(line)
    if text.startswith("mcmd="):
        name, attrs = _tokens(text, "mcmd")
        if attrs:
            raise PmiProtocolError("an mcmd= line carries nothing but the command name")
        return PmiCommand(name, MappingProxyType({}), multiline=True)
    if not text.startswith("cmd="):
        shown = text[:40] + ("..." if len(text) > 40 else "")
        raise PmiProtocolError(f"line does not start with cmd=: {shown!r}")
    name, attrs = _tokens(text, "cmd")
    return PmiCommand(name, MappingProxyType(attrs))


def parse_mcmd_line(line: bytes) -> tuple[str, str]:
    """Parse one line inside an ``mcmd=`` block: ``key=value`` (value to end of line) or a bare
    key such as ``endcmd``."""
    text = _decode(line)
    key, pos = _read_key(text, 0)
    if pos == len(text):
        return key, ""
    if text[pos] != "=":
        raise PmiProtocolError(f"expected key=value in a spawn block, found {text[:40]!r}")
    return key, _read_value(text, pos + 1, stop="")[0]


class SpawnBlock:
    """The lines that follow ``mcmd=spawn``: ``feed`` each one until it returns True, which it
    does at the ``endcmd`` of the last command (``totspawns`` of them)."""

    def __init__(self) -> None:
        self._total: int | None = None
        self._done = 0

    def feed(self, line: bytes) -> bool:
        key, value = parse_mcmd_line(line)
        if key == "totspawns" and self._total is None:
            if not value.isdigit() or int(value) < 1:
                raise PmiProtocolError(f"spawn block with totspawns={value!r}")
            self._total = int(value)
        if key != "endcmd":
            return False
        if self._total is None:
            raise PmiProtocolError("spawn block without totspawns")
        self._done += 1
        return self._done >= self._total


def _escape(value: str) -> str:
    if "\n" in value:
        raise ValueError(f"a PMI value cannot hold a newline: {value!r}")
    return value.replace("\\", "\\\\").replace(" ", "\\ ")


def format_reply(cmd: str, **attrs: object) -> bytes:
    """``cmd=<cmd> k=v ...\\n`` with the attributes in the order given (put ``rc`` first, as
    Hydra does). Spaces and backslashes in values are escaped the way MPICH unescapes them;
    messages meant for old clients should avoid spaces altogether."""
    parts = [f"cmd={cmd}"]
    parts += [f"{key}={_escape(str(value))}" for key, value in attrs.items()]
    return (" ".join(parts) + "\n").encode("utf-8")


def found_reply(value: str) -> bytes:
    """``format_reply("get_result", rc=0, value=value)``, the reply to nearly every get of a
    wire-up, without the generic formatting (`launcher.pmi.proxy`'s fast path)."""
    return b"cmd=get_result rc=0 value=" + _escape(value).encode("utf-8") + b"\n"


def get_line_pattern(kvsname: str, keylen_max: int) -> re.Pattern[bytes] | None:
    """The exact bytes of a plain get of this job as MPICH writes it, ``cmd=get
    kvsname=<kvsname> key=<key>`` and its newline, nothing else; group 1 is the key (1 to
    ``keylen_max`` characters of the key alphabet). A line that matches parses to exactly that
    get, so the proxy may serve it without `parse_line`. None when the kvsname would be
    escaped on the wire or makes the line too long: every get then takes the generic path."""
    if not kvsname or _ESCAPED_OR_CONTROL.search(kvsname) or len(kvsname) > MAX_LINE // 2:
        return None
    return re.compile(b"cmd=get kvsname=" + re.escape(kvsname.encode("ascii"))
                      + rb" key=([A-Za-z0-9_/-]{1,%d})\n" % keylen_max)


_ESCAPED_OR_CONTROL = re.compile(r"[^\x21-\x7e]|\\")  # not printable ASCII, or a backslash


class LineBuffer:
    """Split one connection's byte stream into lines, refusing any line over ``max_line``.

    ``feed`` returns the complete lines (without ``\\n``). An over-long line, finished or not,
    raises ``PmiProtocolError`` whose ``lines`` holds the lines completed before it; the buffer
    is then broken and refuses everything after.
    """

    def __init__(self, max_line: int = MAX_LINE) -> None:
        self._max = max_line
        self._buf = bytearray()
        self._broken = False

    def feed(self, data: bytes) -> list[bytes]:
        if self._broken:
            raise PmiProtocolError("bytes after a rejected line")
        self._buf += data
        lines: list[bytes] = []
        start = 0
        while (end := self._buf.find(b"\n", start)) >= 0:
            if end - start > self._max:
                return self._overflow(lines, end - start)
            lines.append(bytes(self._buf[start:end]))
            start = end + 1
        del self._buf[:start]
        if len(self._buf) > self._max:
            return self._overflow(lines, len(self._buf), finished=False)
        return lines

    def _overflow(self, lines: list[bytes], size: int, finished: bool = True) -> list[bytes]:
        self._broken = True
        self._buf.clear()
        what = f"line of {size} bytes" if finished else f"unfinished line of {size} bytes"
        raise PmiProtocolError(f"{what} exceeds the {self._max}-byte limit", tuple(lines))

    @property
    def pending(self) -> int:
        """Bytes of an unfinished line waiting for its newline."""
        return len(self._buf)
