"""``--cp`` and ``--cp-comm`` as options (pure, one process): the mesh's cp axis and its place
in the rank order, the groups the gradients and the loss are reduced over, and the bad input
refused when the options are read, each with one message naming the flags and the fix. The
training runs are tests/trainer/test_context_parallel_training.py."""

from __future__ import annotations

import re

import pytest

from trainer.comm.topology import MeshShape
from trainer.config.options import make_config, resolve_dp
from trainer.errors import ConfigError
from trainer.placement.parameters import DP_AXES

MESSAGE = re.compile(r"^.+ \[.+\]: .+\. .+$", re.DOTALL)
TINY = {"model": "tiny", "seq_len": 32, "eval_every": 0}


def test_cp_varies_right_after_tp_so_that_a_cp_group_is_adjacent_ranks_of_one_tp_place():
    shape = MeshShape(dp=2, tp=2, cp=2, pp=2)
    assert shape.world_size == 16
    assert shape.groups("cp")[:2] == ((0, 2), (1, 3))
    assert shape.group_ranks(0, "dp") == (0, 4)
    assert shape.group_ranks(0, "pp") == (0, 8)
    assert shape.group_ranks(0, "dp_cp") == (0, 2, 4, 6)


def test_without_cp_every_rank_keeps_its_place():
    for rank in range(8):
        old = MeshShape(dp=2, tp=2, pp=2)
        assert old.coords(rank)["cp"] == 0
        assert old.group_ranks(rank, "dp_cp") == old.group_ranks(rank, "dp")


def test_gradients_are_reduced_over_dp_and_cp_together():
    assert DP_AXES == ("cp", "ep", "zs", "zr")  # edp is (zs, zr): ZeRO-3's hybrid sharding


def test_dp_is_what_remains_of_the_world_after_tp_pp_and_cp():
    cfg = make_config({**TINY, "cp": 2, "tp": 2, "global_batch": 4})
    assert resolve_dp(cfg, 8).parallel.dp == 2
    assert cfg.parallel.describe(" x ") == "dp 0 x tp 2 x pp 1 x cp 2"
    with pytest.raises(ConfigError, match=r"tp\*pp\*cp = 4 ranks") as err:
        resolve_dp(cfg, 6)
    assert MESSAGE.match(str(err.value))


@pytest.mark.parametrize(("options", "message"), [
    ({"cp": 2, "seq_len": 30}, r"sequence does not split over the context-parallel ranks "
     r"\[--seq-len 30 --cp 2\]: .* Choose a --seq-len that is a multiple of 4 \(e\.g\. 28 or "
     r"32\)"),
    ({"cp": 4, "seq_len": 4}, r"\[--seq-len 4 --cp 4\]: .*multiple of 8 \(e\.g\. 8\)"),
    ({"cp": 2, "tp": 4, "n_head": 4, "sequence_parallel": True, "seq_len": 12},
     r"sequence parallelism does not split a context-parallel rank's tokens \["),
    ({"cp": 2, "dropout": 0.1}, r"unsupported combination \[--cp 2 with --dropout 0\.1\]"),
    ({"cp": 2, "compile": True}, r"unsupported combination \[--cp 2 with --compile\]"),
    ({"cp": 2, "zero": 3, "zero_shard_size": 2},
     r"unsupported combination \[--cp 2 with --zero-shard-size 2\]"),
    ({"cp_comm": "alltoall"}, r"--cp-comm"),
], ids=["seq-len-30", "seq-len-below-2cp", "sp-split", "dropout", "compile", "hybrid-zero-3",
        "unknown-exchange"])
def test_what_context_parallelism_cannot_run_is_refused_when_the_options_are_read(
        options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        make_config({**TINY, **options})
    assert MESSAGE.match(str(err.value))


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_2_and_3_shard_over_dp_times_cp(zero: int) -> None:
    assert make_config({**TINY, "cp": 2, "zero": zero}).optimizer.zero == zero


def test_cp_1_checks_nothing_of_the_sequence():
    assert make_config({**TINY, "seq_len": 30}).parallel.cp == 1
