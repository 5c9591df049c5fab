"""``python -m trainer.recsys`` through `dtrain launch` on two network-namespace hosts.

The embedding table is sharded over the two hosts, so every lookup crosses the bridge through
the all-to-all. Nothing of the job may remain on any host afterwards.
"""

from __future__ import annotations

import json

from tests.support import PYTHON, run_dtrain


def test_dlrm_across_two_hosts_completes_with_falling_validation_log_loss(cluster, tmp_path):
    run_dir = tmp_path / "rec"
    res = run_dtrain(["launch", "-H", "node1:1,node2:1", "--ssh-config",
                      str(cluster.ssh_config), "--", PYTHON, "-m", "trainer.recsys",
                      "--steps", "60", "--rows", "8192", "--global-batch", "128",
                      "--eval-every", "20", "--log-every", "20", "--run-dir", str(run_dir)],
                     timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "over 2 rank(s)" in res.stdout + res.stderr
    evals = [json.loads(line) for line in (run_dir / "evals.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [20, 40, 60]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert evals[-1]["val_auc"] > 0.65
    committed = run_dir / "checkpoints" / "step-60"
    assert {p.name for p in committed.glob("rank-*")} == {"rank-00000.safetensors",
                                                          "rank-00001.safetensors"}
