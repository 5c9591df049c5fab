"""``python -m bench.gpu --cpu-tiny``: the GPU validation script, run on a CPU with the tiny
model so it cannot rot between GPU sessions. Rows must be well formed and the launched
training must learn; no timing is asserted (`make bench` and a GPU give the numbers)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from testbed.mpiexec import REPO, clean_env


def test_bench_gpu_in_tiny_cpu_mode_runs_every_part_that_a_cpu_can(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, "-m", "bench.gpu", "--cpu-tiny", "--json", str(out)],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {row["part"]: row for row in json.loads(out.read_text())}
    assert list(rows) == ["throughput", "cpu-precision", "nccl-contract", "launch"]
    speed = rows["throughput"]
    assert (speed["model"], speed["device"], speed["compile"]) == ("tiny", "cpu", False)
    assert speed["dtrain_tok_s"] > 0 and speed["plain_tok_s"] > 0
    assert math.isclose(speed["ratio"], speed["dtrain_tok_s"] / speed["plain_tok_s"])
    assert speed["dtrain_mfu"] is None  # a CPU has no known peak
    cpu = rows["cpu-precision"]
    assert math.isclose(cpu["bf16_over_fp32"], cpu["bf16_step_s"] / cpu["fp32_step_s"])
    assert rows["nccl-contract"]["skipped"] == "no CUDA GPU here"
    launch = rows["launch"]
    assert launch["ok"] and launch["steps"] == 4 and launch["last_loss"] < launch["first_loss"]
    printed = [line for line in done.stdout.splitlines() if line.startswith("part=")]
    assert len(printed) == 4  # one line per row
