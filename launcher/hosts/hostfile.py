"""Hostfiles and inline host lists into `HostEntry` values; nothing is contacted here.

One host per line; `#` starts a comment; blank lines are skipped; CRLF line ends are accepted:

    node1 slots=4                   DeepSpeed
    node1 slots=4 max_slots=8       Open MPI (key=value pairs in any order after the host)
    user@node1 slots=2 port=2222    Open MPI: login user and ssh port of this host
    node1                           a bare host is 1 slot (Open MPI would count CPUs; dtrain
                                    runs one rank per GPU, so it never guesses)
    node1:4                         MPICH Hydra (Hydra's `user=NAME` key is accepted too)
    node5 slots=4 spare             a spare: connected and checked, runs ranks only when it
                                    replaces a failed host (`dtrain launch --max-restarts`)
    [fe80::1]:2  /  [::1] slots=2   IPv6 literals, always in brackets (`host:N` owns the colon)

Every error names `path:line` and is raised before any connection, because a host name flows
into ssh config `%h` expansions, MASTER_ADDR and log lines: a name that could be read as an
option (`-oProxyCommand=...`) or as shell syntax (`h1;reboot`, `h1$(id)`) is refused outright.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass

from launcher.errors import HostfileError, UsageError
from launcher.hosts.names import (
    NAME_FIX,
    ipv6_address,
    shown_text,
    validate_host_name,
    validate_user_name,
)

MAX_LINE_CHARS = 4096
MAX_SLOTS_PER_HOST = 1024      # far above any node's GPU count; stops a typo planning 10**9 ranks
MAX_FILE_BYTES = 8 * 1024 * 1024  # bounds a mistaken `--hostfile /dev/zero`
LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})

# key as written -> field; Open MPI spells max_slots several ways, Hydra has user=.
_KEYS = {"slots": "slots", "max_slots": "max_slots", "max-slots": "max_slots",
         "port": "port", "user": "user"}
_DIGITS_RE = re.compile(r"[0-9]+\Z")


@dataclass(frozen=True)
class HostEntry:
    """One host of the job, as the user wrote it."""

    name: str               # host name or address as written (may be an ~/.ssh/config alias)
    slots: int              # ranks to start there (>= 1)
    user: str | None = None  # from `user@host` or Hydra's `user=`
    port: int | None = None  # from `port=N`
    max_slots: int | None = None
    source: str = ""        # where it came from: "path:line", "-H", or "localhost"
    spare: bool = False     # marked `spare`: stands by for a failed host (launcher.restart)

    def __post_init__(self) -> None:
        # Entries built in code get the same checks as parsed ones.
        where = self.source or self.name
        validate_host_name(self.name, where)
        if self.user is not None:
            validate_user_name(self.user, where)
        if not isinstance(self.slots, int) or not 1 <= self.slots <= MAX_SLOTS_PER_HOST:
            raise HostfileError("bad slot count", where, f"slots={self.slots!r} for "
                                f"{self.name}", f"Use 1..{MAX_SLOTS_PER_HOST}")

    @property
    def is_local(self) -> bool:
        """Loopback names only: the machine's own hostname still goes through ssh."""
        return self.name.lower() in LOCAL_NAMES


def parse_hostfile(path: str | os.PathLike[str]) -> list[HostEntry]:
    """Read and parse a hostfile; every problem names the file and, if any, its line."""
    shown = os.fspath(path)
    data = _read_bounded(shown)
    if data.startswith(b"\xef\xbb\xbf"):  # editors on Windows add a BOM
        data = data[3:]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise HostfileError("hostfile is not UTF-8 text", f"{shown}:{line}",
                            f"byte 0x{data[err.start]:02x} is not valid UTF-8",
                            "Save the file as UTF-8 (plain ASCII host names)") from None
    return parse_hostfile_text(text, shown)


def parse_hostfile_text(text: str, source_name: str) -> list[HostEntry]:
    """Parse hostfile text; `source_name` prefixes every `source` and error location."""
    entries: list[HostEntry] = []
    seen: dict[str, str] = {}
    for number, raw in enumerate(text.split("\n"), start=1):
        where = f"{source_name}:{number}"
        content = _clean_line(raw, where)
        if not content:
            continue
        entry = _parse_line(content, where)
        key = entry.name.lower()
        if key in seen:
            raise HostfileError("duplicate host", where, f"{entry.name} is already listed at "
                                f"{seen[key]}", "List each host once, with its total slots=N")
        seen[key] = where
        entries.append(entry)
    if not entries:
        raise HostfileError("hostfile lists no hosts", source_name,
                            "every line is blank or a comment",
                            "Add one line per host, e.g. `node1 slots=4`")
    return entries


def parse_host_list(spec: str) -> list[HostEntry]:
    """Parse an inline `-H node1:4,node2:4` list (`node1` alone is 1 slot; no duplicates)."""
    if not spec.strip():
        raise HostfileError("empty host list", "-H", "no host was given",
                            "Write e.g. -H node1:4,node2:4")
    entries: list[HostEntry] = []
    seen: set[str] = set()
    for index, item in enumerate(spec.split(","), start=1):
        where = f"-H item {index}"
        item = item.strip()
        if not item:
            raise HostfileError("empty host in list", where, "two commas in a row or a "
                                "trailing comma", "Separate hosts with single commas")
        _check_control(item, where)
        user, name, count = _split_host_token(item, where)
        if name.lower() in seen:
            raise HostfileError("duplicate host", where, f"{name} appears twice",
                                f"Write it once with the total count, e.g. {name}:2")
        seen.add(name.lower())
        slots = _count(count, "slots", where) if count is not None else 1
        entries.append(HostEntry(name, slots, user=user, source="-H"))
    return entries


def local_hosts(nproc_per_node: int) -> list[HostEntry]:
    """No hostfile and no -H: this machine, as localhost, with `nproc_per_node` ranks."""
    if not isinstance(nproc_per_node, int) or not 1 <= nproc_per_node <= MAX_SLOTS_PER_HOST:
        raise UsageError("bad rank count", "--nproc-per-node", f"{nproc_per_node!r} is not "
                         f"in 1..{MAX_SLOTS_PER_HOST}", "Give the number of ranks for localhost")
    return [HostEntry("localhost", nproc_per_node, source="localhost")]


def _read_bounded(shown: str) -> bytes:
    fix = "Check the --hostfile path, or use -H host1:N,host2:N"
    try:
        with open(shown, "rb") as handle:  # open(), not stat(): `<(...)` pipes are fine
            data = handle.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise HostfileError("hostfile not found", shown, "no such file", fix) from None
    except IsADirectoryError:
        raise HostfileError("hostfile unreadable", shown, "it is a directory", fix) from None
    except OSError as err:
        raise HostfileError("hostfile unreadable", shown, err.strerror or str(err),
                            "Check the file's permissions and the path") from None
    if len(data) > MAX_FILE_BYTES:
        raise HostfileError("hostfile too large", shown, f"more than {MAX_FILE_BYTES} bytes",
                            "Point --hostfile at a text file with one host per line")
    if not data.strip():
        raise HostfileError("hostfile is empty", shown, "the file has no content",
                            "Add one line per host, e.g. `node1 slots=4`")
    return data


def _clean_line(raw: str, where: str) -> str:
    """Strip CR, comment and blanks; refuse long lines and control characters."""
    line = raw.removesuffix("\r")
    if len(line) > MAX_LINE_CHARS:
        raise HostfileError("hostfile line too long", where, f"{len(line)} characters "
                            f"(limit {MAX_LINE_CHARS})", "Put one host per line")
    content = line.split("#", 1)[0].strip()
    _check_control(content, where)
    return content


def _check_control(text: str, where: str) -> None:
    for column, ch in enumerate(text, start=1):
        if (ord(ch) < 32 and ch != "\t") or 127 <= ord(ch) < 160 or ch in "\u2028\u2029":
            raise HostfileError("control character in host entry", where,
                                f"U+{ord(ch):04X} at column {column}",
                                "Remove it; only spaces and tabs may separate fields")


def _parse_line(content: str, where: str) -> HostEntry:
    token, *pairs = content.split()
    user, name, count = _split_host_token(token, where)
    fields = _parse_pairs(pairs, where)
    if count is not None and "slots" in fields:
        raise HostfileError("slot count given twice", where, f"{token} and slots= both set "
                            "it", "Use either host:N or host slots=N")
    if "user" in fields:
        if user is not None:
            raise HostfileError("user given twice", where, "user@host and user= both set it",
                                "Keep one of them")
        user = fields["user"]
        validate_user_name(user, where)
    text = count if count is not None else fields.get("slots")
    slots = _count(text, "slots", where) if text is not None else 1
    max_slots = _count(fields["max_slots"], "max_slots", where) if "max_slots" in fields \
        else None
    if max_slots is not None and slots > max_slots:
        raise HostfileError("slots exceed max_slots", where, f"slots={slots} > "
                            f"max_slots={max_slots}", "Lower slots or raise max_slots")
    port = _port(fields["port"], where) if "port" in fields else None
    return HostEntry(name, slots, user=user, port=port, max_slots=max_slots, source=where,
                     spare="spare" in fields)


def _parse_pairs(pairs: list[str], where: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for pair in pairs:
        if pair == "spare":  # a bare mark, not key=value
            if pair in fields:
                raise HostfileError("key given twice", where, "spare appears twice",
                                    "Keep one of them")
            fields[pair] = ""
            continue
        key, eq, value = pair.partition("=")
        if not eq:
            raise HostfileError("unexpected text after the host", where, f"{shown_text(pair)} is "
                                "not key=value", "Remove it, or write slots=N / max_slots=N /"
                                " port=N / spare")
        field = _KEYS.get(key)
        if field is None:
            near = difflib.get_close_matches(key.lower(), list(_KEYS), n=1, cutoff=0.6)
            hint = f"Did you mean {near[0]}=?" if near else ("Known keys: slots, max_slots, port, "
                                                               "and the mark spare")
            raise HostfileError("unknown key", where, f"{shown_text(key)} is not a hostfile key",
                                hint)
        if field in fields:
            raise HostfileError("key given twice", where, f"{key}= appears twice",
                                "Keep one of them")
        fields[field] = value
    return fields


def _split_host_token(token: str, where: str) -> tuple[str | None, str, str | None]:
    """`[user@]host[:N]` or `[user@][v6addr][:N]` -> (user, name, count text)."""
    user = None
    if "@" in token:
        user, _, token = token.partition("@")
        validate_user_name(user, where)
    if token.startswith("["):
        inside, bracket, rest = token[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise HostfileError("invalid host name", where, f"{shown_text(token)} has an "
                                "unbalanced '['", "Write IPv6 as [addr] or [addr]:N")
        if ipv6_address(inside) is None:
            raise HostfileError("invalid host name", where, f"{shown_text(inside)} in brackets "
                                "is not an IPv6 address", NAME_FIX)
        return user, inside, rest[1:] if rest else None
    name, colon, count = token.partition(":")
    if ":" in count:
        raise HostfileError("invalid host name", where, f"{shown_text(token)} has several ':'",
                            "Write IPv6 addresses in brackets, e.g. [fe80::1]:2")
    validate_host_name(name, where)
    return user, name, count if colon else None


def _count(text: str, key: str, where: str) -> int:
    if not _DIGITS_RE.match(text):
        raise HostfileError(f"bad {key} value", where, f"{key}={shown_text(text)} is not a whole "
                            "number", f"Write e.g. {key}=4")
    value = int(text)
    if value < 1:
        raise HostfileError(f"bad {key} value", where, f"{key}={value} must be at least 1",
                            "Remove the host or give it at least one slot")
    if value > MAX_SLOTS_PER_HOST:
        raise HostfileError(f"bad {key} value", where, f"{key}={value} is more than "
                            f"{MAX_SLOTS_PER_HOST}", "Give one slot per GPU (or per rank)")
    return value


def _port(text: str, where: str) -> int:
    if not _DIGITS_RE.match(text) or not 1 <= int(text) <= 65535:
        raise HostfileError("bad port", where, f"port={shown_text(text)} is not a TCP port "
                            "(1..65535)", "Write the host's sshd port, e.g. port=2222")
    return int(text)
