"""Sampling (`trainer.inference.sampling`), in-process.

Merging real checkpoints of tp 2, pp 2 and 3-D runs from their index alone (no parallel model
built), and the CLI, are tested end to end in `tests/trainer/test_evaluation.py`.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from trainer.errors import ConfigError
from trainer.inference.sampling import sample
from trainer.model.config import PRESETS
from trainer.model.gpt import GPT

CFG = PRESETS["tiny"]


@pytest.fixture(scope="module")
def model() -> GPT:
    return GPT(CFG, seed=5).eval()


def test_top_1_sampling_is_the_greedy_continuation_at_any_temperature(model: GPT) -> None:
    greedy = sample(model, b"def ", tokens=12, temperature=0)
    assert len(greedy) == 12
    assert sample(model, b"def ", tokens=12, temperature=5.0, top_k=1, seed=9) == greedy


def test_a_seed_fixes_the_sample_and_leaves_the_global_random_stream_alone(model: GPT) -> None:
    state = torch.get_rng_state()
    a = sample(model, b"x", tokens=20, temperature=1.0, seed=1)
    assert torch.equal(torch.get_rng_state(), state)
    assert sample(model, b"x", tokens=20, temperature=1.0, seed=1) == a
    assert sample(model, b"x", tokens=20, temperature=1.0, seed=2) != a


def test_a_prompt_longer_than_the_context_keeps_only_the_last_seq_len_bytes(model: GPT) -> None:
    long = bytes(range(32, 127)) * 2  # 190 bytes > seq_len 64
    assert sample(model, long, tokens=4, temperature=0) == sample(
        model, long[-CFG.seq_len:], tokens=4, temperature=0)


def test_an_empty_or_out_of_vocabulary_prompt_is_refused(model: GPT) -> None:
    with pytest.raises(ConfigError, match=r"empty prompt \[--prompt\]"):
        sample(model, b"", tokens=1)
    small = GPT(replace(CFG, vocab_size=128), seed=1)
    with pytest.raises(ConfigError, match=r"prompt does not fit the vocabulary \[byte 195\]"):
        sample(small, "\u00ef".encode(), tokens=1)
