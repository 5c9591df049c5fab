"""Host-key policy: OpenSSH semantics on top of paramiko's known_hosts support.

Defaults follow ``StrictHostKeyChecking yes``: an unknown key is refused with its SHA256
fingerprint and the command that would record it. ``accept_new`` is OpenSSH's ``accept-new``
(trust on first use): the key is appended to the user's known_hosts file, and the connection
proceeds. A *changed* key is refused in every mode; paramiko raises ``BadHostKeyException``
before our policy is consulted, and `changed_key_error` turns it into a message naming the
known_hosts line to delete. AutoAddPolicy/WarningPolicy are never used: both accept a
man-in-the-middle.

Not supported (paramiko #771): ``@cert-authority`` host certificates. ``@revoked`` lines are
honoured here (`check_not_revoked`) because failing open on them would be worse than not
parsing them at all.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import paramiko

from launcher.errors import HostKeyError

GLOBAL_KNOWN_HOSTS = (Path("/etc/ssh/ssh_known_hosts"), Path("/etc/ssh/ssh_known_hosts2"))


def key_name(hostname: str, port: int) -> str:
    """The known_hosts name OpenSSH uses: ``host`` for port 22, ``[host]:port`` otherwise."""
    return hostname if port == 22 else f"[{hostname}]:{port}"


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's default fingerprint: ``SHA256:`` + unpadded base64 of the key blob's digest."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def _known_lines(paths: Iterable[Path]) -> Iterator[tuple[Path, int, list[str]]]:
    """(file, line number, fields) of every non-comment line of the readable files."""
    for path in paths:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            fields = line.split()
            if fields and not fields[0].startswith("#"):
                yield path, lineno, fields


def _glob(pattern: str) -> re.Pattern[str]:
    """OpenSSH patterns know only ``*`` and ``?``; ``[`` is literal (``[host]:port``)."""
    return re.compile(re.escape(pattern).replace(r"\*", ".*").replace(r"\?", "."))


def _names_match(patterns: str, name: str) -> bool:
    """OpenSSH host-pattern matching for one known_hosts name field (hashed, wildcards, !neg)."""
    matched = False
    for pattern in patterns.split(","):
        if pattern.startswith("|1|"):
            hit = paramiko.HostKeys.hash_host(name, pattern) == pattern
        else:
            negate = pattern.startswith("!")
            hit = _glob(pattern.lstrip("!")).fullmatch(name) is not None
            if hit and negate:
                return False
        matched = matched or hit
    return matched


def _key_of(fields: list[str]) -> tuple[str, str]:
    """(key type, base64) of a known_hosts line's fields, skipping a leading @marker."""
    rest = fields[2:] if fields[0].startswith("@") else fields[1:]
    return (rest[0], rest[1]) if len(rest) >= 2 else ("", "")


def load_into(keys: paramiko.HostKeys, paths: Iterable[Path]) -> None:
    """Add the plain entries of the readable files to ``keys``.

    paramiko's own ``HostKeys.load`` raises on ``@revoked``/``@cert-authority`` lines (their
    key field is not base64), which would make one such line break every connection.
    """
    for _path, lineno, fields in _known_lines(paths):
        if fields[0].startswith("@"):
            continue
        try:
            entry = paramiko.hostkeys.HostKeyEntry.from_line(" ".join(fields[:3]), lineno)
        except (paramiko.hostkeys.InvalidHostKey, paramiko.SSHException, ValueError):
            continue
        if entry is not None:
            for name in entry.hostnames:
                keys.add(name, entry.key.get_name(), entry.key)


def find_entries(name: str, paths: Iterable[Path]) -> list[tuple[Path, int, str, str]]:
    """Where ``name`` is listed: (file, line, key type, base64) of every plain entry naming it.

    Unlike paramiko's lookup this honours wildcard and negated patterns, as OpenSSH does.
    """
    found = []
    for path, lineno, fields in _known_lines(paths):
        if not fields[0].startswith("@") and _names_match(fields[0], name):
            found.append((path, lineno, *_key_of(fields)))
    return found


def check_not_revoked(name: str, key: paramiko.PKey, paths: Iterable[Path], where: str) -> None:
    """Refuse a key listed on a matching ``@revoked`` line (OpenSSH fails closed on these)."""
    blob = key.get_base64()
    for path, lineno, fields in _known_lines(paths):
        revoked = fields[0] == "@revoked" and len(fields) >= 4
        if revoked and _names_match(fields[1], name) and _key_of(fields)[1] == blob:
            raise HostKeyError(
                f"host key of {name} is revoked", where,
                f"the server presented {key.get_name()} {fingerprint(key)}, which "
                f"{path}:{lineno} marks @revoked",
                "Do not connect; ask the host's administrator for its current key",
            )


def unknown_key_error(name: str, key: paramiko.PKey, where: str, port: int, host: str,
                      known_hosts: Path) -> HostKeyError:
    """The refusal for a host whose key is in no known_hosts file."""
    port_opt = "" if port == 22 else f"-p {port} "
    return HostKeyError(
        f"host key of {name} is not known", where,
        f"the server presented {key.get_name()} {fingerprint(key)} and no entry for {name} "
        f"exists in {known_hosts} or the global known_hosts files",
        f"Verify the fingerprint out of band, then run "
        f"`ssh-keyscan {port_opt}{host} >> {known_hosts}`, or pass --ssh-accept-new to "
        f"record new host keys on first contact",
    )


def changed_key_error(name: str, got: paramiko.PKey, expected: paramiko.PKey,
                      paths: Iterable[Path], where: str) -> HostKeyError:
    """The refusal for a host whose key differs from the recorded one (always fatal)."""
    entries = find_entries(name, paths)
    lines = ", ".join(f"{p}:{n}" for p, n, *_ in entries) or "a known_hosts file"
    first = entries[0][0] if entries else Path("~/.ssh/known_hosts")
    return HostKeyError(
        f"host key of {name} has CHANGED", where,
        f"the server presented {got.get_name()} {fingerprint(got)} but {lines} records "
        f"{expected.get_name()} {fingerprint(expected)}; someone may be doing a "
        f"man-in-the-middle attack, or the host was reinstalled",
        f"Only if the change is legitimate, delete that line "
        f"(`ssh-keygen -R '{name}' -f {first}`) and connect again; "
        f"--ssh-accept-new never accepts a changed key",
    )


def _make_private_dir(path: Path) -> None:
    """Create missing parents with mode 0700 (like ~/.ssh), leaving existing ones alone."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass


def append_known_host(path: Path, name: str, key: paramiko.PKey, where: str) -> None:
    """Record ``name keytype base64`` in ``path`` (trust on first use), safely and once.

    The file is opened with its final mode (0600, no chmod window: CVE-2022-24302), locked so
    parallel handshakes of one launch do not interleave lines, re-read under the lock so a
    racing writer's entry is honoured (equal: nothing to add; different: changed key), and
    fsynced so a crash right after launch does not lose the record.
    """
    _make_private_dir(path.parent)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        recorded = paramiko.HostKeys()
        load_into(recorded, [path])
        known = recorded.lookup(name)
        if known is not None:
            same = known.get(key.get_name())
            if same is not None and same == key:
                return
            if same is not None:
                raise changed_key_error(name, key, same, [path], where)
        line = f"{name} {key.get_name()} {key.get_base64()}\n"
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = "\n" + line  # a hand-edited file without a final newline
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


class KnownHostsPolicy(paramiko.MissingHostKeyPolicy):
    """Called by paramiko only for keys that no loaded known_hosts file lists."""

    def __init__(self, *, known_hosts: Path, read_from: tuple[Path, ...], accept_new: bool,
                 where: str, host: str, port: int) -> None:
        self.known_hosts, self.read_from, self.accept_new = known_hosts, read_from, accept_new
        self.where, self.host, self.port = where, host, port

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str,
                         key: paramiko.PKey) -> None:
        check_not_revoked(hostname, key, self.read_from, self.where)
        # paramiko matches names literally; OpenSSH also honours wildcard patterns.
        same_type = [e for e in find_entries(hostname, self.read_from) if e[2] == key.get_name()]
        if any(b64 == key.get_base64() for *_, b64 in same_type):
            return
        if same_type:
            expected = paramiko.PKey.from_type_string(same_type[0][2],
                                                      base64.b64decode(same_type[0][3]))
            raise changed_key_error(hostname, key, expected, self.read_from, self.where)
        if not self.accept_new:
            raise unknown_key_error(hostname, key, self.where, self.port, self.host,
                                    self.known_hosts)
        append_known_host(self.known_hosts, hostname, key, self.where)
