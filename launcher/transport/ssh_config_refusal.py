"""Reading ssh_config as ssh reads it, and refusing what would run a local command.

`read_config` returns every line of the file, with ``Include`` spliced in place, each with its
``file:line`` origin and its keyword tokenised the way OpenSSH and paramiko do: leading
whitespace, an optionally double-quoted keyword matched case-insensitively, ``Key value`` or
``Key=value``. ``Include`` takes shell-style quoted words; ``~`` is expanded, a relative path is
taken relative to ``~/.ssh`` (OpenSSH's rule for user configs, ``-F`` files included) or to
``/etc/ssh`` (for the system config, `IncludeRule`), globs are expanded in lexical order,
patterns matching nothing are skipped, nesting stops at 16 levels.

The refusals, unless ``--ssh-allow-config-exec`` (``SSHOptions.allow_config_exec``):

* `refuse_match_exec`: a ``Match`` line with an ``exec`` criterion, in any file, before
  paramiko reads anything (paramiko runs ``Match exec`` while looking up *any* host). Its
  criteria are split like ssh and paramiko split them (shell quotes and escapes, ``!``
  negation, ``criterion=argument``, any case), and a line naming ``exec`` anywhere is refused,
  so neither reader can find an ``exec`` this one missed.
* `refuse_host_commands`: for the host being resolved, the parsed (looked-up) values of the
  directives with which ssh runs a local command (``ProxyCommand``, ``KnownHostsCommand``,
  ``LocalCommand`` when ``PermitLocalCommand yes``) or loads a shared library into its helpers
  (``PKCS11Provider``, ``SecurityKeyProvider`` other than ``internal``): `REFUSED`, one table
  for both clients. With the option, ProxyCommand runs as the transport; paramiko never runs
  KnownHostsCommand (host keys come from known_hosts files) or LocalCommand (it opens no
  interactive session) and loads no provider; `ssh` does what its config says.

Every refusal is one `ConnectError` naming ``file:line`` and the option.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from launcher.errors import ConnectError

_KEYWORD = re.compile(r'^\s*"?(\w+)"?(?:\s*=\s*|\s+)(.*?)\s*$')
_MAX_DEPTH = 16
_ALLOW = "--ssh-allow-config-exec"
#: The system-wide config, read by `ssh` whenever it is not given -F.
SYSTEM_CONFIG = Path("/etc/ssh/ssh_config")


@dataclass(frozen=True)
class Refused:
    """An ssh_config directive with which ssh runs code of the config's choosing for a host."""

    #: The directive as ssh's manual spells it.
    name: str
    #: What ssh would do with it, `{}` standing for the value ("... would run ...").
    runs: str
    #: Values that mean "nothing" (ssh's own default included).
    inactive: tuple[str, ...] = ("none",)


#: Every directive refused without --ssh-allow-config-exec, by lower-cased keyword (Match exec
#: aside: it is refused on the raw lines, before anything parses the file).
REFUSED = {
    "proxycommand": Refused("ProxyCommand", "the local shell command `{}` to reach it"),
    "knownhostscommand": Refused("KnownHostsCommand",
                                 "the local command `{}` to list its host keys"),
    "localcommand": Refused("LocalCommand",
                            "the local command `{}` after connecting (PermitLocalCommand yes)"),
    "pkcs11provider": Refused("PKCS11Provider", "the code of the shared library `{}` "
                              "(ssh-pkcs11-helper loads it)"),
    "securitykeyprovider": Refused("SecurityKeyProvider", "the code of the shared library `{}` "
                                   "(ssh-sk-helper loads it)", ("internal",)),
}


@dataclass(frozen=True)
class IncludeRule:
    """Where an ``Include`` looks, as OpenSSH decides it: ``~`` is ``home``, and a relative
    path is under ``base`` (``home``/.ssh in user and -F files, /etc/ssh in the system one)."""

    home: Path
    base: Path

    @classmethod
    def user(cls, home: Path | None = None) -> IncludeRule:
        home = home if home is not None else Path.home()
        return cls(home, home / ".ssh")

    @classmethod
    def system(cls, home: Path) -> IncludeRule:
        return cls(home, SYSTEM_CONFIG.parent)


@dataclass(frozen=True)
class ConfigLine:
    """One line of an ssh config, Include already spliced in."""

    text: str
    origin: str                 # "file:line"
    keyword: str | None = None  # lower-cased; None for blank and comment lines
    value: str = ""


def parse_line(text: str, origin: str) -> ConfigLine:
    """Split one line into keyword and value like ssh and paramiko (no quotes stripped)."""
    stripped = text.strip()
    match = _KEYWORD.match(stripped)
    if not stripped or stripped.startswith("#") or not match:
        return ConfigLine(text, origin)  # a line paramiko cannot parse fails in paramiko
    return ConfigLine(text, origin, match.group(1).lower(), match.group(2))


def words(line: ConfigLine) -> list[str]:
    """The shell-style words of a value (quotes and backslashes as ssh's argv_split)."""
    try:
        return shlex.split(line.value)
    except ValueError as exc:
        raise ConnectError("cannot parse ssh config", line.origin, f"{exc} in "
                           f"`{line.text.strip()}`", "Fix the quoting of the line") from None


def read_config(path: Path, rule: IncludeRule | None = None, depth: int = 0
                ) -> list[ConfigLine]:
    """Every line of ``path`` with Include directives replaced by the files they name
    (``rule``: a user config's by default)."""
    rule = rule if rule is not None else IncludeRule.user()
    if depth > _MAX_DEPTH:
        raise ConnectError("ssh config Include nesting too deep", str(path),
                           f"more than {_MAX_DEPTH} levels (an Include loop?)",
                           "Fix the Include lines")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConnectError("cannot read ssh config", str(path), str(exc),
                           "Fix the file or pass another with --ssh-config") from None
    lines: list[ConfigLine] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = parse_line(raw, f"{path}:{lineno}")
        if line.keyword != "include":
            lines.append(line)
            continue
        for included in include_paths(words(line), rule):
            lines += read_config(included, rule, depth + 1)
    return lines


def include_paths(patterns: Sequence[str], rule: IncludeRule) -> list[Path]:
    """The files an ``Include`` names: ~ expanded, relative ones under the rule's base, globs
    sorted."""
    found: list[Path] = []
    for pattern in patterns:
        if pattern == "~" or pattern.startswith("~/"):
            full = rule.home / pattern[2:]
        else:
            full = Path(os.path.expanduser(pattern))  # ~user
        full = full if full.is_absolute() else rule.base / full
        found += [Path(p) for p in sorted(glob.glob(str(full)))]
    return found


def refuse_match_exec(lines: Sequence[ConfigLine]) -> None:
    """Refuse every ``Match`` line with an ``exec`` criterion, however it is spelled."""
    for line in lines:
        if line.keyword != "match":
            continue
        criteria = [part for word in words(line) for part in word.split("=")]
        if any(c.lstrip("!").lower() == "exec" for c in criteria):
            raise ConnectError(
                "ssh config directive `Match exec` refused", line.origin,
                "looking up any host in this file would run its local shell command",
                f"Remove the Match exec block, point --ssh-config at another file, or pass "
                f"{_ALLOW} if you trust this file")


def refuse_host_commands(host: str, found: dict[str, str],
                         origin_of: Callable[[str], str]) -> None:
    """Refuse the looked-up `REFUSED` directives of ``host`` (``found``: paramiko's lookup or
    what `ssh -G` prints; the keys are lower-cased in both)."""
    for key, refused in REFUSED.items():
        value = command_value(found, key)
        if value is None:
            continue
        if key == "localcommand" and found.get("permitlocalcommand", "no").lower() != "yes":
            continue
        fix = "Use ProxyJump instead, or pass" if key == "proxycommand" else "Remove it, or pass"
        raise ConnectError(f"ssh config directive `{refused.name}` refused", origin_of(key),
                           f"host {host} would run " + refused.runs.format(value),
                           f"{fix} {_ALLOW} if you trust this file")


def command_value(found: dict[str, str], key: str) -> str | None:
    """A `REFUSED` directive's value, None when unset or inactive (``none``: "no command")."""
    value = found.get(key)
    inactive = REFUSED[key].inactive if key in REFUSED else ("none",)
    if value is None or not str(value).strip() or str(value).strip().lower() in inactive:
        return None
    return str(value)

