"""Rendezvous mode on the command line: the head's options of `dtrain launch`, and `dtrain
agent`'s (adapter: click). Each option also reads its DTRAIN_RDZV_* variable where a pod
template sets it once for every node; the defaults are those of `launcher.rendezvous.options`.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import click

from launcher.errors import UsageError
from launcher.rendezvous import options as rdzv
from launcher.transport import table

#: The head's options, in the order --help shows them.
HEAD_OPTIONS = ("rendezvous_port", "rendezvous_host", "nnodes", "token_file",
                "rendezvous_timeout")
_TOKEN_HELP = ("File holding the shared token that proves head and agents to each other "
               "(made by `dtrain token new > FILE`; no access for other users).")


def _apply(fn: Callable[..., Any], opts: list[Callable[[Any], Any]]) -> Callable[..., Any]:
    return functools.reduce(lambda f, opt: opt(f), reversed(opts), fn)


def head_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`dtrain launch`'s rendezvous options: listen for agents instead of reaching hosts."""
    return _apply(fn, [
        click.option("--rendezvous-port", type=click.IntRange(1, 65535),
                     help="Rendezvous mode: listen on this port for N agents started "
                     "elsewhere (`dtrain agent --rendezvous THIS_HOST:PORT`)."),
        click.option("--rendezvous-host", metavar="ADDRESS",
                     help="Listen on this address only (default: every address)."),
        click.option("--nnodes", type=click.IntRange(min=1),
                     help="Rendezvous mode: the number of agents to wait for."),
        click.option("--token-file", envvar=rdzv.ENV_TOKEN_FILE, type=click.Path(dir_okay=False),
                     help=_TOKEN_HELP),
        click.option("--rendezvous-timeout", type=click.FloatRange(min=0),
                     default=rdzv.RendezvousOptions.timeout, show_default=True,
                     help="Seconds to wait for every agent; then one error naming those "
                     "that came."),
    ])


def head_request(kw: dict[str, Any], launcher: str, *, hosts_given: bool
                 ) -> tuple[str, rdzv.RendezvousOptions | None]:
    """The launcher row and the head's RendezvousOptions (the options are taken out of
    ``kw``): --rendezvous-port selects the join row; a UsageError for a half or conflicting
    set."""
    port, host, nnodes = kw.pop("rendezvous_port"), kw.pop("rendezvous_host"), kw.pop("nnodes")
    token_file, timeout = kw.pop("token_file"), kw.pop("rendezvous_timeout")
    if port is None:
        if host is not None or nnodes is not None:
            raise UsageError("incomplete rendezvous options", "--rendezvous-host/--nnodes",
                             "they only apply with --rendezvous-port", "add --rendezvous-port")
        return launcher, None
    missing = [name for name, value in (("--nnodes", nnodes), ("--token-file", token_file))
               if value is None]
    if missing:
        raise UsageError("incomplete rendezvous options", "--rendezvous-port",
                         f"{' and '.join(missing)} not given",
                         "give --nnodes N and --token-file F (or DTRAIN_RDZV_TOKEN_FILE)")
    if hosts_given:
        raise UsageError("conflicting host options", "--rendezvous-port", "the hosts are the "
                         "agents that join; --hostfile, -H and --num-nodes do not apply",
                         "drop them, or drop --rendezvous-port")
    joins = table.of_flow(table.Flow.JOIN).name
    if launcher not in (joins, table.DEFAULT_LAUNCHER):
        raise UsageError("conflicting launchers", f"--launcher {launcher}", "--rendezvous-port "
                         f"selects --launcher {joins}", f"drop --launcher {launcher}")
    return joins, rdzv.RendezvousOptions(port=port, nnodes=nnodes, token_file=token_file,
                                         host=host or "", timeout=timeout)


def agent_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`dtrain agent`'s options."""
    return _apply(fn, [
        click.option("--rendezvous", "endpoint", envvar=rdzv.ENV_ENDPOINT, required=True,
                     metavar="HOST:PORT", help="The head's address and --rendezvous-port."),
        click.option("--token-file", envvar=rdzv.ENV_TOKEN_FILE, required=True,
                     type=click.Path(dir_okay=False), help=_TOKEN_HELP),
        click.option("--node-rank", envvar=rdzv.ENV_NODE_RANK, type=click.IntRange(min=0),
                     help="This node's place in the job (default: by host name)."),
        click.option("--join-timeout", envvar=rdzv.ENV_TIMEOUT, type=click.FloatRange(min=0),
                     default=rdzv.JoinOptions.timeout, show_default=True,
                     help="Seconds to keep trying to reach the head."),
    ])


def join_request(kw: dict[str, Any]) -> rdzv.JoinOptions:
    host, port = rdzv.parse_endpoint(kw["endpoint"], "--rendezvous")
    return rdzv.JoinOptions(host=host, port=port, token_file=kw["token_file"],
                            node_rank=kw["node_rank"], timeout=kw["join_timeout"])


@click.group("token")
def token_group() -> None:
    """The shared token of rendezvous mode (--token-file)."""


@token_group.command("new")
@click.argument("file", required=False, type=click.Path(dir_okay=False))
def token_new(file: str | None) -> None:
    """Write a new token: to FILE (created owner-only, never over an existing file), else to
    standard output (a file it is redirected to is made owner-only first).

    \b
      dtrain token new > token
      kubectl create secret generic dtrain-token --from-file=token
    """
    from launcher.rendezvous import tokens

    try:
        tokens.write(file)
    except UsageError as exc:
        click.echo(f"dtrain: error: {exc}", err=True)
        sys.exit(exc.exit_code)
