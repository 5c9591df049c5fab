"""The Flight Recorder shim on NCCL process groups (on a GPU; skipped without one): the same
code path as gloo's (`launcher/agent/flight_shim`): the recorder's collectives, the wrapped
send and recv (coalesced by NCCL here) merged by entry time, and a hang named culprit first
with two GPUs."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import torch

from launcher.agent import flight
from tests.support import PYTHON, REPO, run_dtrain

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

WORKER = str(REPO / "tests" / "support" / "workers" / "nccl_flight.py")


def test_an_nccl_rank_s_collectives_and_point_to_point_operations_reach_the_shims_file(
        tmp_path):
    record = str(tmp_path / "rank-0.progress")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29631"}
    for name in (*flight.BUFFER_NAMES, flight.FILE):
        env.pop(name, None)
    env.update(flight.rank_env(env, record, 0.2))
    done = subprocess.run([PYTHON, WORKER, "record", "2"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    body = json.loads((tmp_path / "rank-0.progress.flight.json").read_text())
    assert body["spins"] is True  # NCCL's waiting ranks spin: their CPU is no progress
    (world,) = [g for g in body["groups"] if g["label"] == "world"]
    # NCCL's recorder may add entries of its own around the coalesced pair; the program's
    # operations are there, in order, and every operation is counted in the sequence.
    ops = [(seq, op, peer, colls) for seq, op, peer, colls in world["history"]
           if op in ("all_reduce", "send", "recv")]
    assert [(op, peer) for _, op, peer, _ in ops] == \
        [("all_reduce", -1)] * 3 + [("send", 0), ("recv", 0)], world
    assert [row[3] for row in ops] == [1, 2, 3, 3, 3]  # collectives keep their count
    seqs = [row[0] for row in world["history"]]
    assert seqs == sorted(set(seqs)) and world["seq"] == world["done"] == seqs[-1], world

@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_an_nccl_rank_that_skips_an_all_reduce_is_named_first(tmp_path):
    res = run_dtrain(["launch", "--nproc-per-node", "2", "--hang-timeout", "5",
                      "--hang-action", "abort", "--grace", "1", "--log-dir", str(tmp_path),
                      "--", PYTHON, WORKER, "skip"], timeout=300)
    assert res.returncode == 123, res.stderr[-3000:]
    (path,) = tmp_path.glob("*/hang-1.txt")
    first = path.read_text().splitlines()[0]
    assert "cause: rank 1 (localhost) never entered all_reduce #3 on world" in first, first
    assert float(re.search(r"no rank made progress for ([\d.]+)s", first)[1]) < 5 + 3
