"""``--time-limit`` (`trainer.stopping.time_limit`): every rank stops after the same step.

The agreement is a pure rule over one all-reduce, tested here with a communicator that plays
the other ranks; a real 3-rank run stopped by its time limit is in
`tests/cluster/test_hang_cluster.py` (the several-minute healthy job).
"""

from __future__ import annotations

import pytest
import torch

from trainer.comm.protocol import ReduceOp
from trainer.config.options import parse_args
from trainer.errors import ConfigError
from trainer.stopping.time_limit import TimeLimit


class OtherRanks:
    """All-reduces (MAX) this rank's flag with the other ranks' ``others``."""

    def __init__(self, others: float) -> None:
        self.others, self.calls = others, 0

    def all_reduce(self, t: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *,
                   async_op: bool = False) -> None:
        assert op == ReduceOp.MAX
        self.calls += 1
        t.clamp_(min=self.others)


def limit(seconds: float, others: float, every: int = 5) -> TimeLimit:
    return TimeLimit(seconds, OtherRanks(others), every, torch.device("cpu"))


def test_a_rank_whose_clock_has_not_run_out_stops_with_the_rank_whose_clock_has():
    early = limit(3600.0, others=1.0)
    assert early.reached(5)


def test_no_rank_stops_while_every_clock_has_time_left():
    assert not limit(3600.0, others=0.0).reached(5)


def test_a_rank_past_its_limit_stops_every_rank_at_that_check():
    late = limit(1e-9, others=0.0)
    assert late.reached(10)  # its own time is up: MAX makes it everyone's


def test_the_ranks_agree_only_every_log_interval_and_never_without_a_limit():
    checked = limit(1e-9, others=1.0, every=5)
    assert [checked.reached(s) for s in (1, 2, 4, 5)] == [False, False, False, True]
    assert checked.comm.calls == 1
    off = limit(0.0, others=1.0)
    assert not off.reached(5) and off.comm.calls == 0


def test_a_negative_time_limit_is_refused_naming_the_option():
    with pytest.raises(ConfigError, match="--time-limit -1"):
        parse_args(["--time-limit", "-1"], quiet=True)
    assert parse_args(["--time-limit", "90"], quiet=True).time_limit == 90.0
