"""Switching a ZeRO-3 model to tensor-parallel generation and back without a checkpoint
(`trainer.inference.switch`), with real MPI ranks at dp 4 in fp64
(`tests/support/zero_workers/switch.py`).

* The greedy tokens of the switched model (tp 2: two groups with their own prompts; tp 4)
  equal those of the same weights merged into the single-process GPT, sampled on this
  process (`trainer.inference.sampling`). fp64 keeps the TP sums' rounding (row-parallel
  all-reduces, ~1e-16 relative) far below any gap between the two likeliest bytes.
* After switching back the parameter shards, gradient shards and AdamW state are bit-equal to
  before, nothing is left gathered, and training continues bit for bit as a run that never
  switched (same losses, same final shards).
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import pytest
import torch

from tests.support import REPO, dtrain_env
from tests.support.mpi_runs import forked_python, run_ranks, world_run
from tests.support.numerics import float64
from tests.support.zero_workers.switch import PROMPTS, TOKENS, switch_config
from trainer.errors import ConfigError
from trainer.inference.sampling import sample_ids
from trainer.inference.switch import check_layout
from trainer.model.family import build_model

WORKER = "tests.support.zero_workers.switch:run"


@functools.cache
def ranks() -> list[dict]:
    return world_run(WORKER, 4).ranks


@functools.cache
def serial_tokens(prompt: tuple[int, ...]) -> list[int]:
    with float64():
        model = build_model(switch_config("unused").gpt)
        model.load_state_dict(ranks()[0]["whole"])
        return sample_ids(model.eval(), list(prompt), tokens=TOKENS, temperature=0)


def test_every_rank_merged_the_same_weights_at_the_switch() -> None:
    for rank in ranks()[1:]:
        for key, value in ranks()[0]["whole"].items():
            assert torch.equal(rank["whole"][key], value), key


@pytest.mark.parametrize("rank", range(4))
def test_greedy_tokens_at_tp2_equal_the_merged_single_process_model(rank: int) -> None:
    assert ranks()[rank]["tp2"] == serial_tokens(tuple(PROMPTS[rank // 2]))


@pytest.mark.parametrize("rank", range(4))
def test_greedy_tokens_at_tp4_equal_the_merged_single_process_model(rank: int) -> None:
    assert ranks()[rank]["tp4"] == serial_tokens(tuple(PROMPTS[0]))


def test_the_two_groups_sampled_their_own_prompts() -> None:
    assert serial_tokens(tuple(PROMPTS[0])) != serial_tokens(tuple(PROMPTS[1]))


def _bit_equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _bit_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(
            _bit_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("rank", range(4))
def test_after_switching_back_parameters_and_optimizer_state_are_bit_equal(rank: int) -> None:
    got = ranks()[rank]
    assert _bit_equal(got["before"], got["after"])
    assert got["gathered_after"] == ([], 0)


@pytest.mark.parametrize("rank", range(4))
def test_training_continues_exactly_as_without_the_switch(rank: int) -> None:
    got = ranks()[rank]
    assert got["losses"] == got["plain_losses"]
    assert _bit_equal(got["final"], got["plain_final"])


def test_generate_from_run_samples_the_merged_models_greedy_text_from_zero3_shards(
        tmp_path: Path) -> None:
    """``python -m trainer.generate --from-run --tp 2`` on 4 ranks rebuilds a dp 2 zero 1 run's
    checkpoint as ZeRO-3 shards over 4 ranks, switches to tp 2 and prints (once) what the
    single-process merge of the same checkpoint prints. fp32 as users run it: greedy steps
    agree unless two bytes' logits tie within fp32 rounding."""
    train = run_ranks(2, ["-m", "trainer.train", "--model", "tiny", "--n-layer", "2",
                          "--n-head", "4", "--d-model", "32", "--seq-len", "32",
                          "--global-batch", "8", "--dp", "2", "--zero", "1", "--steps", "3",
                          "--data-cap-mb", "0.25", "--eval-every", "0",
                          "--run-dir", str(tmp_path)])
    assert train.returncode == 0, train.stdout[-3000:]
    sample = ["-m", "trainer.generate", "--run-dir", str(tmp_path), "--prompt", "def ",
              "--tokens", "12", "--temperature", "0"]
    switched = run_ranks(4, [*sample, "--from-run", "--tp", "2"])
    assert switched.returncode == 0, switched.stdout[-3000:]
    merged = subprocess.run([*forked_python(), *sample], cwd=REPO, env=dtrain_env(),
                            capture_output=True, text=True, timeout=300, check=False)
    assert merged.returncode == 0, merged.stderr[-3000:]
    text = merged.stdout  # the prompt, its continuation (whitespace, maybe) and a newline
    assert text.startswith("def ") and len(text) > len("def \n")
    assert switched.stdout.count(text) == 1, (text, switched.stdout[-3000:])


def test_generate_from_run_refuses_a_tp_that_does_not_divide_the_ranks() -> None:
    with pytest.raises(ConfigError, match=r"invalid generation layout \[tp 3 over dp 4\]"):
        check_layout(3, 4)
