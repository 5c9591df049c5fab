"""Command-line flags (and ``--config FILE``) for any config dataclass of `trainer.schema`.

Precedence: built-in defaults < the TOML file < flags. Every option has one flag and one TOML
key (`trainer.schema.Option`); argparse prints the help declared with each option, grouped by
section. ``quiet`` parses without printing usage, errors or help (every rank of a job but one)
and keeps argparse's exit codes.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, TypeVar

from trainer.config.toml_file import load_toml
from trainer.schema import Option, build, nest, options_of

#: A config class (a frozen dataclass of sections).
C = TypeVar("C")


class QuietParser(argparse.ArgumentParser):
    """An argparse parser that can stay silent (and still exits with argparse's codes)."""

    def __init__(self, *args: Any, quiet: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.quiet = quiet

    def _print_message(self, message: str, file: Any = None) -> None:
        if not self.quiet:
            super()._print_message(message, file)


def option_table(cls: type) -> dict[str, Option]:
    """Every option of ``cls`` by flag name."""
    return {o.flag: o for o in options_of(cls)}


def build_parser(cls: type, *, prog: str, description: str,
                 quiet: bool = False) -> argparse.ArgumentParser:
    """A flag for every option of ``cls``; unset flags are absent from the result."""
    parser = QuietParser(prog=prog, description=description, quiet=quiet,
                         argument_default=argparse.SUPPRESS)
    parser.add_argument("--config", metavar="FILE", help="TOML file of options (a table per "
                        "section, e.g. [optimizer]); flags override it")
    groups: dict[str, Any] = {"": parser}
    for opt in options_of(cls):
        if opt.table not in groups:
            groups[opt.table] = parser.add_argument_group(f"[{opt.table}]")
        target = groups[opt.table]
        if opt.kind is bool:
            target.add_argument(opt.cli, dest=opt.flag, action=argparse.BooleanOptionalAction,
                                help=opt.help)
        else:
            target.add_argument(opt.cli, dest=opt.flag, type=opt.kind,
                                metavar=opt.kind.__name__.upper(), help=opt.help)
    return parser


def parse(cls: type[C], argv: Sequence[str] | None, *, prog: str, description: str,
          quiet: bool = False) -> C:
    """``cls`` from the flags (and the file named by ``--config``), checked."""
    given = vars(build_parser(cls, prog=prog, description=description,
                              quiet=quiet).parse_args(argv))
    path = given.pop("config", None)
    table = option_table(cls)
    values = load_toml(path, table) if path else {}
    values.update(given)
    config: C = build(cls, nest(values, table))
    return config
