"""The table of transports: every way to reach agents is one row, the command line's choices
come from it, and `launch` and `check` ask it rather than test names. And what a dispatching
row's hosts get when they are not reachable yet: more tries, until the launch timeout."""

from __future__ import annotations

import ast
import inspect
import sys
import threading

import click
import pytest

from launcher import check as check_module
from launcher import launch as launch_module
from launcher.cli import check, launch
from launcher.errors import ConnectError, UnreachableError, UsageError
from launcher.hosts.hostfile import HostEntry
from launcher.hosts.selection import HostSlots
from launcher.transport import connect, table
from launcher.transport.options import SSHOptions


def _choices(command: click.Command, name: str) -> list[str]:
    [param] = [p for p in command.params if p.name == name]
    assert isinstance(param.type, click.Choice)
    return list(param.type.choices)


def test_every_row_names_a_function_that_exists() -> None:
    for transport in table.TRANSPORTS:
        assert callable(transport.load()), transport.name
        if transport.explain:
            assert callable(table._function(transport.explain)), transport.name


def test_the_command_lines_choices_are_the_tables_rows() -> None:
    assert _choices(launch, "launcher_kind") == table.launchers()
    assert _choices(check, "launcher_kind") == table.launchers(checks=True)
    assert _choices(launch, "ssh_client") == list(table.SSH_CLIENTS)
    assert {"ssh", "slurm", "mpirun"} <= set(table.launchers())
    assert "mpirun" not in table.launchers(checks=True)


def test_a_host_is_reached_by_its_own_row_loopback_locally_the_rest_by_the_ssh_client() -> None:
    openssh_opts = SSHOptions(client="openssh")
    assert table.for_host(HostEntry("localhost", 1), openssh_opts).name == "local"
    assert table.for_host(HostEntry("node1", 1), openssh_opts).name == "openssh"
    assert table.for_host(HostEntry("node1", 1), SSHOptions()).name == "paramiko"


def test_an_unknown_transport_is_one_usage_error_naming_the_rows() -> None:
    with pytest.raises(UsageError, match=r"--launcher.*'pdsh' is not one of ssh, slurm"):
        table.get("pdsh")


@pytest.mark.parametrize("module", [launch_module, check_module])
def test_launch_and_check_name_no_transport(module: object) -> None:
    chosen = {*table.launchers(), *table.SSH_CLIENTS}  # the names a user picks a row by
    tree = ast.parse(inspect.getsource(module))  # type: ignore[arg-type]
    strings = {node.value for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert not strings & chosen, "ask launcher.transport.table"


# -- hosts not reachable yet (a fake dispatch row; the real one:
# tests/launcher/test_kubernetes.py) ----
_calls: list[list[str]] = []


class _Stream:
    """Stands for an agent stream that opened: it only records what the head writes."""

    connection = None

    def __init__(self, host: str) -> None:
        self.host, self.written = host, []

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def close(self) -> None:
        """Nothing to close."""


def start_flaky(selected, *, python, ssh, opened):
    """`late` does not resolve for the first two rounds; `bad` refuses authentication; each
    stream is told to ``opened``, numbered as in ``selected``."""
    _calls.append([h.entry.name for h in selected])
    results = [UnreachableError("cannot resolve host name", h.entry.name, "name not resolved")
            if h.entry.name == "late" and len(_calls) < 3 else
            ConnectError("cannot connect", h.entry.name, "authentication failed")
            if h.entry.name == "bad" else _Stream(h.entry.name) for h in selected]
    for index, result in enumerate(results):
        if isinstance(result, _Stream):
            opened(index, result)
    return results


FLAKY = table.Transport("flaky", table.Flow.DISPATCH, "", f"{__name__}:start_flaky")


@pytest.fixture
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    monkeypatch.setattr(connect, "RETRY_PAUSE_S", (0.01, 0.02))
    _calls.clear()
    return _calls


def _hosts(*names: str) -> list[HostSlots]:
    return [HostSlots(HostEntry(name, 1), (0,), False) for name in names]


def test_a_host_not_reachable_yet_is_tried_again_with_a_line_per_round_naming_it(
        quick_retries: list[list[str]], capsys: pytest.CaptureFixture[str]) -> None:
    told: list[tuple[int, str]] = []
    streams = connect.open_streams(_hosts("early", "late"), python=sys.executable,
                                   ssh=SSHOptions(), transport=FLAKY, retry_for=10,
                                   opened=lambda i, stream: told.append((i, stream.host)))
    assert [s.host for s in streams] == ["early", "late"]
    assert told == [(0, "early"), (1, "late")]  # as each opened, numbered among all hosts
    assert quick_retries == [["early", "late"], ["late"], ["late"]]  # only it, again
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and all("1 host(s) not reachable yet: late (name not resolved)" in
                                   line for line in lines)


def test_a_host_that_refuses_us_fails_the_launch_at_once_without_retries(
        quick_retries: list[list[str]]) -> None:
    with pytest.raises(ConnectError, match="2 hosts could not be reached"):
        connect.open_streams(_hosts("late", "bad"), python=sys.executable, ssh=SSHOptions(),
                             transport=FLAKY, retry_for=10)
    assert quick_retries == [["late", "bad"]]


def test_a_host_still_unreachable_at_the_launch_timeout_is_the_error(
        quick_retries: list[list[str]]) -> None:
    with pytest.raises(UnreachableError, match="name not resolved"):
        connect.open_streams(_hosts("late"), python=sys.executable, ssh=SSHOptions(),
                             transport=FLAKY, retry_for=0)


class _ClosingConnection:
    """An AgentConnection whose close says which thread ran it; a slow one (paramiko's
    kind) waits in its close until ``meet`` has all its parties."""

    def __init__(self, closers: list[str], meet: threading.Barrier | None = None) -> None:
        self.closers, self.meet, self.slow_close = closers, meet, meet is not None

    def close(self) -> None:
        self.closers.append(threading.current_thread().name)
        if self.meet is not None:
            self.meet.wait(timeout=10)


class _ClosingStream:
    def __init__(self, connection: _ClosingConnection) -> None:
        self.connection, self.closed = connection, False

    def close(self) -> None:
        self.closed = True


def test_connections_that_close_at_once_close_inline_and_slow_ones_together() -> None:
    quick: list[str] = []
    slow: list[str] = []
    meet = threading.Barrier(3)  # every slow close waits for the other two: never serial
    streams = [_ClosingStream(_ClosingConnection(quick)) for _ in range(100)]
    streams += [_ClosingStream(_ClosingConnection(slow, meet)) for _ in range(3)]
    connect.close_streams(streams)  # type: ignore[arg-type]
    assert all(s.closed for s in streams)
    assert quick == [threading.current_thread().name] * 100
    assert len(slow) == 3 and not meet.broken
