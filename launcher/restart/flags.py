"""The `dtrain launch` options of restarts (click), and the `RestartOptions` they make.

Their defaults are `RestartOptions`'s, written once in `launcher.restart.policy`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import click

from launcher.restart.policy import RestartOptions, parse_codes

#: The destinations, for the "Restarts" section of `dtrain launch --help`.
NAMES = ("max_restarts", "restart_backoff", "no_restart_on", "spares", "min_nodes",
         "exclude_after", "restart_check")
_DEFAULT = RestartOptions()


def restart_flags(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Add the restart options to a click command."""
    opts = [
        click.option("--max-restarts", type=click.IntRange(min=0),
                     default=_DEFAULT.max_restarts, show_default=True,
                     help="After a failure, stop every rank and start the job again, up to N "
                     "times (agents stay connected; blamed hosts are replaced by spares)."),
        click.option("--restart-backoff", type=click.FloatRange(min=0),
                     default=_DEFAULT.backoff, show_default=True,
                     help="Seconds before the first restart; doubled for each further one "
                     "(at most 60)."),
        click.option("--no-restart-on", metavar="CODES", show_default=True,
                     default=",".join(map(str, sorted(_DEFAULT.no_restart_on))),
                     help="Exit codes that are never restarted (comma-separated, or `none`); "
                     "2 is the trainer's code for bad input."),
        click.option("--spares", type=click.IntRange(min=0), default=_DEFAULT.spares,
                     help="The last K hosts stand by as spares (as hosts marked `spare` in "
                     "the hostfile): each takes a failed host's place."),
        click.option("--min-nodes", type=click.IntRange(min=1), default=_DEFAULT.min_nodes,
                     help="Without a spare, go on without a failed host while at least M "
                     "hosts remain (the program sees the smaller world)."),
        click.option("--exclude-after", type=click.IntRange(min=0),
                     default=_DEFAULT.exclude_after, show_default=True,
                     help="A host blamed this many times is not used again in the job (0: "
                     "never; for long jobs whose failures are transient)."),
        click.option("--restart-check", is_flag=True, default=_DEFAULT.restart_check,
                     help="Run the `dtrain check` probes on a spare before it takes a place."),
    ]
    return functools.reduce(lambda f, opt: opt(f), reversed(opts), fn)


def restart_options(kw: dict[str, Any]) -> RestartOptions:
    """The options' values (taken out of ``kw``) as `RestartOptions`."""
    try:
        codes = parse_codes(kw.pop("no_restart_on"))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--no-restart-on'") from None
    return RestartOptions(max_restarts=kw.pop("max_restarts"), backoff=kw.pop("restart_backoff"),
                          no_restart_on=codes, spares=kw.pop("spares"),
                          min_nodes=kw.pop("min_nodes"), restart_check=kw.pop("restart_check"),
                          exclude_after=kw.pop("exclude_after"))
