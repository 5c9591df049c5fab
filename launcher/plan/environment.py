"""The environment every rank gets on top of its contract variables (the plan's base_env).

Composed on the head node, later sources winning:

1. head variables whose names start with an allow-listed prefix (`workerenv.FORWARDED_PREFIXES`:
   NCCL_, PYTHON, CUDA_, ..., and the frameworks' DS_, ACCELERATE_, PL_, NVTE_, ...) or are
   named in `workerenv.FORWARDED_NAMES` (PATH, VIRTUAL_ENV, CONDA_PREFIX, CONDA_DEFAULT_ENV:
   the rank's `python` is the one the head's shell finds).
   Never the whole environment: LD_PRELOAD, BASH_ENV and secrets stay home.
   CUDA_VISIBLE_DEVICES is not forwarded either: it describes the head's GPUs, not the
   workers' (select GPUs with --include host:0,1);
2. `~/.dtrainenv`, then `./.dtrainenv` (in the launch directory), when they exist, like
   DeepSpeed's `.deepspeed_env`;
3. `--env KEY=VALUE`, in order.

A `.dtrainenv` is read only when it is a regular file owned by the user (or root) that
neither group nor others can write, checked on the open file (`open_env_file`): every rank gets
its variables (LD_PRELOAD, PYTHONPATH...), so one written by someone else, in a shared or
world-writable launch directory, is refused with one error before anything starts. The head
says once how many variables each file gave (`compose_base_env`'s ``tell``).

A `.dtrainenv` line is `KEY=VALUE`, optionally after `export `; `#` lines and blank lines are
skipped. VALUE is literal (no `$VAR` expansion) and may be quoted: '...' keeps everything,
"..." understands \\" \\\\ \\n \\t; an unquoted value ends at ` #` (a comment). Values can hold any
character except NUL, because they travel to the agent as data and never through a shell.

On each host the agent composes a rank's environment with `rank_environment`: its own
environment (scrubbed), then the planned variables, except that a planned PATH is merged with
the host's own by `merge_path`: the planned (head's) entries first, then the host's entries
not already in it. argv[0] thus resolves as on the head wherever the head's directories exist
(a virtualenv on a shared or identically laid-out filesystem), and falls back to the host's
own tools where they do not, which `dtrain check` reports.

Variables that belong to another launcher (PMI_*, PMIX_*, OMPI_*, SLURM_*) and the contract
variables the plan writes (RANK, MASTER_ADDR, ...) are refused when given explicitly, since a
silently ignored setting is worse than an error; inherited ones are dropped.
"""

from __future__ import annotations

import io
import os
import re
import stat
from collections.abc import Callable, Mapping, Sequence

import workerenv as we
from launcher.errors import EnvironmentFileError, UsageError

TYPE_CHECKING = False  # importing `typing` costs every agent's start-up; mypy reads True
if TYPE_CHECKING:
    from pathlib import Path
    from typing import NoReturn

ENV_FILE_NAME = ".dtrainenv"
#: Contract variables only the plan may set (CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS and
#: TORCH_NCCL_ASYNC_ERROR_HANDLING may be set).
LAUNCHER_OWNED = frozenset({
    we.RANK, we.WORLD_SIZE, we.LOCAL_RANK, we.LOCAL_WORLD_SIZE, we.GROUP_RANK, we.NODE_RANK,
    we.MASTER_ADDR, we.MASTER_PORT, we.JOB_ID, we.HOST, we.TORCHELASTIC_RUN_ID,
    we.TORCHELASTIC_RESTART_COUNT, we.TORCHELASTIC_MAX_RESTARTS, we.TORCHELASTIC_USE_AGENT_STORE,
    we.ROLE_RANK, we.ROLE_NAME, we.ROLE_WORLD_SIZE, we.GROUP_WORLD_SIZE,
})
NOT_FORWARDED = frozenset({we.CUDA_VISIBLE_DEVICES})
#: The planned variables that decide which program a rank's argv[0] runs (PATH is searched, a
#: virtualenv or conda prefix says which interpreter): all that a host is sent before it starts
#: ranks (its check of the job, a spare's, `dtrain check`); the rest, secrets among them
#: (HF_TOKEN, WANDB_API_KEY), travel only with START (`program_env`).
PROGRAM_LOOKUP = (we.PATH, "VIRTUAL_ENV", "CONDA_PREFIX", "CONDA_DEFAULT_ENV")
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_COMMENT_RE = re.compile(r"\s#")
_ESCAPES = {'"': '"', "\\": "\\", "n": "\n", "t": "\t"}


def forwarded_env(head_environ: Mapping[str, str],
                  prefixes: Sequence[str] = we.FORWARDED_PREFIXES,
                  names: Sequence[str] = we.FORWARDED_NAMES) -> dict[str, str]:
    """Head variables with an allow-listed prefix or name, minus scrubbed and launcher-owned."""
    prefixes = tuple(prefixes)
    return {name: value for name, value in scrub(head_environ).items()
            if (name.startswith(prefixes) or name in names) and _NAME_RE.match(name)
            and name not in NOT_FORWARDED and name not in LAUNCHER_OWNED}


def program_env(planned: Mapping[str, str]) -> dict[str, str]:
    """The planned variables that decide which program a rank runs (`PROGRAM_LOOKUP`)."""
    return {name: planned[name] for name in PROGRAM_LOOKUP if name in planned}


def merge_path(first: str, then: str) -> str:
    """A PATH of ``first``'s entries, then ``then``'s entries that are not already in it."""
    entries: list[str] = []
    for entry in (*first.split(os.pathsep), *then.split(os.pathsep)):
        if entry not in entries:
            entries.append(entry)
    return os.pathsep.join(entries)


def rank_environment(host_environ: Mapping[str, str],
                     planned: Mapping[str, str]) -> dict[str, str]:
    """A rank's environment on its host: the host's own (scrubbed), then the planned variables;
    a planned PATH goes in front of the host's PATH rather than replacing it."""
    env = scrub(host_environ)
    env.update(planned)
    if we.PATH in planned and host_environ.get(we.PATH):
        env[we.PATH] = merge_path(planned[we.PATH], host_environ[we.PATH])
    return env


def scrub(environ: Mapping[str, str]) -> dict[str, str]:
    """Drop variables of other launchers (workerenv.SCRUBBED_PREFIXES)."""
    return {k: v for k, v in environ.items() if not k.startswith(we.SCRUBBED_PREFIXES)}


def read_env_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """Parse a `.dtrainenv` file; errors name `file:line` and never echo a value."""
    shown = os.fspath(path)
    try:
        with open_env_file(shown) as f:
            data = f.read()
    except OSError as err:
        raise EnvironmentFileError("environment file unreadable", shown,
                                   err.strerror or str(err), "Check the path and its "
                                   "permissions") from None
    result: dict[str, str] = {}
    for number, raw in enumerate(data.split(b"\n"), start=1):
        where = f"{shown}:{number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise EnvironmentFileError("environment file is not UTF-8", where, "the line "
                                       "holds bytes that are not UTF-8",
                                       "Save the file as UTF-8") from None
        parsed = _parse_line(line.removesuffix("\r"), where)
        if parsed is not None:
            result[parsed[0]] = parsed[1]
    return result


def open_env_file(shown: str) -> io.FileIO:
    """The file opened, then judged by what was opened (no swap between check and read): a
    regular file (a FIFO would block, a device never end), owned by us or root, not writable
    by group or others. Raises EnvironmentFileError naming the file and the fix."""
    fd = os.open(shown, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO opens at once
    f = os.fdopen(fd, "rb", buffering=0)
    try:
        st = os.fstat(fd)
        why = fix = ""
        if not stat.S_ISREG(st.st_mode):
            why, fix = "it is not a regular file", "Replace it with a regular file"
        elif st.st_uid not in (os.geteuid(), 0):
            why = (f"it belongs to {_user_name(st.st_uid)}, not to you, and its variables would "
                   "reach every rank (LD_PRELOAD, PYTHONPATH...)")
            fix = "Remove it if you did not write it, or keep your variables in a file you own"
        elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            who = {stat.S_IWGRP: "its group", stat.S_IWOTH: "every user"}
            writers = " and ".join(w for bit, w in who.items() if st.st_mode & bit)
            why = (f"{writers} can write it (mode {stat.filemode(st.st_mode)}), and its "
                   "variables would reach every rank")
            fix = f"Run `chmod go-w {shown}` if its content is yours"
        if why:
            raise EnvironmentFileError("environment file refused", shown, why, fix)
    except BaseException:
        f.close()
        raise
    return f


def _user_name(uid: int) -> str:
    import pwd  # only on the way to a refusal

    try:
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def parse_env_assignments(items: Sequence[str], where: str = "--env") -> dict[str, str]:
    """Parse `KEY=VALUE` items (VALUE taken verbatim, may be empty); later items win."""
    result: dict[str, str] = {}
    for index, item in enumerate(items, start=1):
        name, eq, value = item.partition("=")
        place = f"{where} {name}" if _NAME_RE.match(name) else f"{where} item {index}"
        if not eq:
            raise EnvironmentFileError("missing '='", place, "expected KEY=VALUE",
                                       f"Write {where} NAME=value (NAME=$NAME copies yours)")
        _check_name(name, place, UsageError)
        _check_value(value, place)
        result[name] = value
    return result


def compose_base_env(head_environ: Mapping[str, str], *, cwd: str, cli_env: Sequence[str] = (),
                     env_files: Sequence[Path] | None = None,
                     tell: Callable[[str], object] | None = None) -> dict[str, str]:
    """forwarded prefixes, then env files (default ~/.dtrainenv, ./.dtrainenv), then --env;
    ``tell`` gets one line saying how many variables each env file gave, when there was one."""
    env = forwarded_env(head_environ)
    files = default_env_files(head_environ, cwd) if env_files is None else env_files
    counts = []
    for path in files:
        variables = read_env_file(path)
        env.update(variables)
        counts.append(f"{len(variables)} variable{'s' * (len(variables) != 1)} from {path}")
    if counts and tell is not None:
        tell(f"environment files: {', '.join(counts)}")
    env.update(parse_env_assignments(cli_env))
    return env


def default_env_files(head_environ: Mapping[str, str], cwd: str) -> list[Path]:
    """`~/.dtrainenv` then `<cwd>/.dtrainenv`, those that exist, each once."""
    from pathlib import Path  # here, not above: every agent imports this module at start-up

    home = head_environ.get("HOME") or str(Path.home())
    found: list[Path] = []
    for path in (Path(home) / ENV_FILE_NAME, Path(cwd) / ENV_FILE_NAME):
        if path.is_file() and all(not path.samefile(seen) for seen in found):
            found.append(path)
    return found


def _parse_line(line: str, where: str) -> tuple[str, str] | None:
    text = line.strip()
    if not text or text.startswith("#"):
        return None
    if text.startswith(("export ", "export\t")):
        text = text[len("export"):].lstrip()
    name, eq, rest = text.partition("=")
    if not eq:
        raise EnvironmentFileError("malformed line", where, "expected KEY=VALUE",
                                   "Write one NAME=value per line")
    _check_name(name, where, EnvironmentFileError)
    value = _parse_value(rest, where)
    _check_value(value, where)
    return name, value


def _parse_value(rest: str, where: str) -> str:
    if rest[:1] == "'":
        value, quote, tail = rest[1:].partition("'")
        if not quote:
            _unterminated(where, "'")
    elif rest[:1] == '"':
        value, tail = _double_quoted(rest[1:], where)
    else:
        match = _COMMENT_RE.search(rest)
        return (rest[:match.start()] if match else rest).strip()
    if tail.strip() and not tail.strip().startswith("#"):
        raise EnvironmentFileError("text after a quoted value", where, "only a # comment may "
                                   "follow the closing quote", "Quote the whole value")
    return value


def _double_quoted(text: str, where: str) -> tuple[str, str]:
    out: list[str] = []
    index = 0
    while index < len(text):
        ch = text[index]
        if ch == '"':
            return "".join(out), text[index + 1:]
        if ch == "\\" and index + 1 < len(text) and text[index + 1] in _ESCAPES:
            out.append(_ESCAPES[text[index + 1]])
            index += 2
            continue
        out.append(ch)
        index += 1
    _unterminated(where, '"')


def _unterminated(where: str, quote: str) -> NoReturn:
    raise EnvironmentFileError("unterminated quote", where, f"the value opens {quote} and the "
                               "line ends first", "Close the quote on the same line")


def _check_name(name: str, where: str, error: type[UsageError | EnvironmentFileError]
                ) -> None:
    if not _NAME_RE.match(name):
        raise EnvironmentFileError("bad variable name", where, f"{name[:40]!r} is not a name "
                                   "([A-Za-z_][A-Za-z0-9_]*)", "Write NAME=value without "
                                   "spaces around '='")
    if name.startswith(we.SCRUBBED_PREFIXES):
        raise error("variable of another launcher", where, f"{name} starts with one of "
                    f"{', '.join(we.SCRUBBED_PREFIXES)}, which dtrain removes so MPICH does "
                    "not join a stale job", "Remove it; the agent sets the PMI variables")
    if name in LAUNCHER_OWNED:
        raise error("launcher variable", where, f"{name} is set per rank by dtrain's plan",
                    "Remove it; use the launcher's options to change it")


def _check_value(value: str, where: str) -> None:
    if "\0" in value:
        raise EnvironmentFileError("NUL in value", where, "an environment value cannot "
                                   "contain NUL", "Remove the NUL byte")
