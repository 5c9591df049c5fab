"""Host and user names as dtrain accepts them: plain, portable, never readable as an option
or as shell syntax, because a name flows into ssh config `%h` expansions, MASTER_ADDR and log
lines. Errors say what the name would have meant elsewhere (an Open MPI `^host`, a `%` token).
"""

from __future__ import annotations

import ipaddress
import re

from launcher.errors import HostfileError

_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*\Z")
_USER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9._-]*\Z")
_SHELL_CHARS = set(";&|$`'\"<>()[]{}*?!~\\#")
# Characters with a known meaning elsewhere, so the message can say what the user meant.
_SPECIAL_CHARS = {
    "%": "which ssh expands as a token",
    "=": "the host name comes first, then key=value pairs",
    "^": "Open MPI's ^host exclusion is not supported; use --exclude",
    "+": "Open MPI's relative +nN hosts are not supported",
    ":": "which is only allowed inside an IPv6 address in brackets",
    "@": "write user@host with a single '@'",
    ",": "write one host per line (or per -H item)",
}
NAME_FIX = ("Write the host's DNS name, IP address or ~/.ssh/config alias "
             "(letters, digits, '.', '-', '_'; IPv6 in brackets)")


def validate_host_name(name: str, where: str) -> None:
    """Raise HostfileError unless `name` is a plain host name, IPv4 or (unbracketed) IPv6."""
    why = _host_name_problem(name)
    if why:
        raise HostfileError("invalid host name", where, why, NAME_FIX)


def validate_user_name(user: str, where: str) -> None:
    """Raise HostfileError unless `user` is a portable login name (it reaches ssh and logs)."""
    if _USER_RE.match(user) and len(user) <= 32:
        return
    shown = shown_text(user)
    why = (f"user name {shown} is empty" if not user else
           f"user name {shown} starts with '-', so it would be read as an option"
           if user.startswith("-") else
           f"user name {shown} is not a portable login name")
    raise HostfileError("invalid user name", where, why,
                        "Use letters, digits, '.', '-', '_' (starting with a letter or '_')")


def ipv6_address(text: str) -> ipaddress.IPv6Address | None:
    try:
        return ipaddress.IPv6Address(text) if "%" not in text else None
    except ValueError:
        return None


def _host_name_problem(name: str) -> str:
    """Why `name` is refused, or "" when it is fine."""
    shown = shown_text(name)
    if _NAME_RE.match(name) and len(name) <= 253:
        return ""
    if ":" in name and ipv6_address(name) is not None:
        return ""
    if not name:
        return "the host name is empty"
    if len(name) > 253:
        return f"{len(name)} characters is longer than a DNS name can be (253)"
    if name.startswith("-"):
        return f"{shown} starts with '-', so ssh and other tools would read it as an option"
    for ch in name:
        if ch.isspace() or ord(ch) < 32 or ord(ch) == 127:
            return f"{shown} contains whitespace or a control character"
        if ch in _SPECIAL_CHARS:
            return f"{shown} contains {ch!r}, {_SPECIAL_CHARS[ch]}"
        if ch in _SHELL_CHARS:
            return f"{shown} contains {ch!r}, which is shell syntax"
        if not ch.isascii() or not (ch.isalnum() or ch in "._-"):
            return f"{shown} contains {ch!r}, which is not allowed in host names"
    return f"{shown} starts with {name[0]!r}; a host name starts with a letter or digit"


def shown_text(text: str, limit: int = 60) -> str:
    """repr() for messages, cut short so a 4 KiB line does not flood the terminal."""
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 4] + "...'"
