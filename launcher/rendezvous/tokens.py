"""The rendezvous token's one accepted form, made by `dtrain token new`.

    dtrain-token-1-<64 hex digits: 256 random bits>-<8 hex digits: a check>

Only this form is accepted: a token someone typed or derived from a word can be guessed by
whoever reaches the port (or records an exchange), one made here cannot. The check (the first
4 bytes of SHA-256 over the rest) tells a token cut short or mistyped in a copy from a
different token, so such a file is refused at once, on its own node, naming the file, instead
of failing every handshake.

`write` puts a new token where the user asked without a moment in which others can read it: a
named file is created owner-only (never over an existing one); standard output redirected to
a file (`dtrain token new > token`) is made owner-only before a byte is written, since the
shell created it with the umask's mode.
"""

from __future__ import annotations

import os
import re
import stat

from launcher.errors import UsageError

PREFIX = "dtrain-token-1-"
RANDOM_BYTES = 32  # 256 bits; the floor is 128
_FORM = re.compile(rf"{re.escape(PREFIX)}([0-9a-f]{{{2 * RANDOM_BYTES}}})-([0-9a-f]{{8}})")
MAKE_ONE = "make one with `dtrain token new > token` (it is written owner-only)"


def new() -> str:
    """A fresh token in the accepted form."""
    import secrets  # only `dtrain token new` draws one; every launch imports this module

    body = secrets.token_hex(RANDOM_BYTES)
    return f"{PREFIX}{body}-{_check(body)}"


def why_not(text: str) -> str:
    """"" for a token in the accepted form, else why it is not one (never quoting it)."""
    found = _FORM.fullmatch(text)
    if found is None:
        return (f"it is not a token made by `dtrain token new` (one line: {PREFIX} and "
                f"{2 * RANDOM_BYTES} random hex digits, then a check)")
    if found.group(2) != _check(found.group(1)):
        return "its check digits do not match: the token was cut short or changed in a copy"
    return ""


def _check(body: str) -> str:
    import hashlib  # only rendezvous jobs check a token; every launch imports this module

    return hashlib.sha256(f"{PREFIX}{body}".encode()).hexdigest()[:8]


def write(path: str | None) -> None:
    """A new token into ``path`` (created, mode 0600), or onto standard output; UsageError
    when that would leave it readable by others or overwrite something."""
    line = (new() + "\n").encode()
    if path is not None:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
        except FileExistsError:
            raise UsageError("the token file exists", path, "a token is never written over "
                             "another (agents of a running job may hold it)",
                             "remove it first, or name a new file") from None
        except OSError as exc:
            raise UsageError("cannot create the token file", path, exc.strerror or str(exc),
                             "name a file in a folder you can write") from None
        try:
            os.fchmod(fd, 0o600)  # the umask may have taken more than group and other bits
            os.write(fd, line)
        finally:
            os.close(fd)
        return
    out = 1
    info = os.fstat(out)
    if stat.S_ISREG(info.st_mode):
        if info.st_size:
            raise UsageError("standard output is a file that is not empty", "dtrain token new",
                             f"it holds {info.st_size} bytes; a token file holds the token only",
                             "redirect to a new file: `dtrain token new > token`")
        try:
            os.fchmod(out, 0o600)  # before the token is in it: the shell made it 0644 or so
        except OSError as exc:
            raise UsageError("cannot make the token file owner-only", "dtrain token new > FILE",
                             exc.strerror or str(exc), "use `dtrain token new FILE` on a file "
                             "of your own") from None
    os.write(out, line)
