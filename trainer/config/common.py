"""The sections every trainer shares (``python -m trainer.train`` and ``trainer.recsys``):
checkpoints and logging. Each option is declared with its help and bounds (`trainer.schema`)."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.errors import ConfigError
from trainer.schema import Section, option


@dataclass(frozen=True, kw_only=True)
class CheckpointSection(Section):
    """When checkpoints are written, how many are kept, and whether a run continues one."""

    save_every: int = option(0, "save a checkpoint every N steps (0 = only at the end)",
                             at_least=0)
    keep: int = option(2, "number of newest checkpoints to keep (0 = all)", at_least=0)
    resume: bool = option(False, "continue from the newest committed checkpoint in --run-dir "
                          "(none: start at step 0); refused if its checksums do not verify")
    overwrite: bool = option(False, "start a new run in a --run-dir that holds another run's "
                             "checkpoints (refused without it): they and metrics.jsonl are "
                             "moved to <run-dir>/replaced-<time>/")

    def check(self) -> None:
        if self.overwrite and self.resume:
            raise ConfigError("--overwrite with --resume", "--overwrite --resume",
                              "--resume continues the checkpoints that --overwrite sets aside",
                              "Drop one of them")


@dataclass(frozen=True, kw_only=True)
class LoggingSection(Section):
    """What a run reports, and how often."""

    log_every: int = option(10, "print a log line every N steps", at_least=1)
    eval_every: int = option(50, "log the validation loss every N steps and at the last step "
                             "(0 = never)", at_least=0)
