"""The Llama and tokenized-data benches in tiny configurations: well-formed rows only (timings
are never asserted; this machine is shared and loaded)."""

from __future__ import annotations

import json
import subprocess

from tests.support import PYTHON, REPO, dtrain_env


def rows(*args: str) -> list[dict]:
    done = subprocess.run([PYTHON, "-m", *args], capture_output=True, text=True, cwd=REPO,
                          env=dtrain_env(), timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_the_llama_step_bench_times_dtrain_and_every_installed_peer() -> None:
    got = rows("bench.llama_step", "--sizes", "tiny", "--steps", "1", "--reps", "1")
    assert [r["side"] for r in got] == ["dtrain", "transformers", "torchtitan"]
    assert got[0]["tokens_per_s"] > 0
    for peer in got[1:]:  # timed, or said to be missing
        assert peer.get("dtrain_over_this", 0) > 0 or "not installed" in peer["note"]


def test_the_loader_bench_compares_with_training_and_with_tokenizers() -> None:
    got = rows("bench.token_loader", "--tokens", "200000", "--text-mb", "0.2")
    assert [r["part"] for r in got] == ["loader", "loader", "prepare"]
    assert all(r["ratio"] > 0 for r in got)
