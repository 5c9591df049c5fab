"""The table of transports: every way to reach agents is one row, the command line's choices
come from it, and `launch` and `check` ask it rather than test names."""

from __future__ import annotations

import ast
import inspect

import click
import pytest

from launcher import check as check_module
from launcher import launch as launch_module
from launcher.cli import check, launch
from launcher.errors import UsageError
from launcher.hosts.hostfile import HostEntry
from launcher.transport import table
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
