"""Sampling bytes from a byte-level GPT: greedy (temperature 0), or temperature and top-k.

Each new byte is drawn from the model's next-token distribution given at most ``seq_len``
previous bytes (the context it was trained on); the random stream is a private generator
seeded with ``seed``, so a sample is reproducible and the global RNG is untouched.
"""

from __future__ import annotations

import torch

from trainer.errors import ConfigError
from trainer.model.gpt import GPT


@torch.no_grad()
def sample(model: GPT, prompt: bytes, *, tokens: int, temperature: float = 1.0,
           top_k: int = 0, seed: int = 0) -> bytes:
    """``tokens`` bytes continuing ``prompt`` (ids are bytes)."""
    vocab = model.cfg.vocab_size
    if not prompt:
        raise ConfigError("empty prompt", "--prompt", "sampling continues at least one byte",
                          "Pass a non-empty --prompt")
    if max(prompt) >= vocab:
        raise ConfigError("prompt does not fit the vocabulary", f"byte {max(prompt)}",
                          f"the model's vocab_size is {vocab}",
                          f"Use a prompt whose bytes are below {vocab}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    idx = torch.tensor([list(prompt)], dtype=torch.long)
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
    return bytes(idx[0, len(prompt):].tolist())
