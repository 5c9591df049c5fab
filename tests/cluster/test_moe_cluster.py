"""Expert-parallel training across two network-namespace hosts (each with its own sshd):
each host holds half of every MoE layer's experts, and tokens cross hosts in the all-to-all.
"""

from __future__ import annotations

import json

from tests.support import PYTHON, run_dtrain


def test_ep2_training_across_two_hosts_completes_and_its_loss_falls(cluster, tmp_path):
    run_dir = tmp_path / "ep2"
    res = run_dtrain(["launch", "-H", "node1:1,node2:1", "--ssh-config", str(cluster.ssh_config),
                      "--", PYTHON, "-m", "trainer.train", "--model", "tiny", "--moe-experts",
                      "4", "--moe-topk", "2", "--ep", "2", "--steps", "30", "--log-every", "10",
                      "--data-cap-mb", "1", "--eval-every", "0", "--run-dir", str(run_dir)],
                     timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3
    tokens = [r["moe"]["blocks.0.mlp"]["tokens"] for r in rows]
    assert all(sum(t) == 32 * 64 * 2 for t in tokens)  # the preset's batch x seq x top-2
    assert (run_dir / "expert_load.png").is_file()
