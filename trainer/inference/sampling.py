"""Sampling bytes from a byte-level GPT: greedy (temperature 0), or temperature and top-k.

Each new byte is drawn from the model's next-token distribution given at most ``seq_len``
previous bytes (the context it was trained on); the random stream is a private generator
seeded with ``seed``, so a sample is reproducible and the global RNG is untouched.
"""

from __future__ import annotations

import torch

from trainer.errors import ConfigError
from trainer.model.gpt import GPT


def sample(model: GPT, prompt: bytes, *, tokens: int, temperature: float = 1.0,
           top_k: int = 0, seed: int = 0) -> bytes:
    """``tokens`` bytes continuing ``prompt`` (ids are bytes: a model of at most 256 ids)."""
    if model.cfg.vocab_size > 256:
        raise ConfigError("not a byte-level model", f"vocab_size {model.cfg.vocab_size}",
                          "its ids above 255 are no bytes", "Sample ids with sample_ids")
    return bytes(sample_ids(model, list(prompt), tokens=tokens, temperature=temperature,
                            top_k=top_k, seed=seed, unit="byte"))


@torch.no_grad()
def sample_ids(model: GPT, prompt: list[int], *, tokens: int, temperature: float = 1.0,
               top_k: int = 0, seed: int = 0, unit: str = "token") -> list[int]:
    """``tokens`` ids continuing the ids of ``prompt`` (a tokenizer's, or bytes: ``unit``
    names them in errors)."""
    vocab = model.cfg.vocab_size
    if not prompt:
        raise ConfigError("empty prompt", "--prompt", f"sampling continues at least one {unit}",
                          "Pass a non-empty --prompt")
    if max(prompt) >= vocab:
        raise ConfigError("prompt does not fit the vocabulary", f"{unit} {max(prompt)}",
                          f"the model's vocab_size is {vocab}",
                          f"Use a prompt whose {unit}s are below {vocab}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    idx = torch.tensor([prompt], dtype=torch.long)
    for _ in range(tokens):
        logits = model(idx[:, -model.cfg.seq_len:])[0, -1].float()
        if temperature == 0:
            nxt = logits.argmax().reshape(1)
        else:
            logits = logits / temperature
            if 0 < top_k < vocab:
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        idx = torch.cat([idx, nxt.reshape(1, 1)], dim=1)
    return idx[0, len(prompt):].tolist()
