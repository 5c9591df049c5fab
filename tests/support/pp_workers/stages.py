"""Synthetic equal-cost pipeline stages (a linear layer and tanh each) and their serial reference.

Every rank builds every stage's layer from one seed and keeps its own chunks (chunk c of rank r
is stage c*p + r), so the pipelined run and the serial run in the pytest process start from the
same weights and read the same microbatches. The loss of a microbatch is the mean squared error
of the last stage's output, divided by m, so summing microbatches gives the batch loss.
"""

from __future__ import annotations

import torch
from torch import nn

from trainer.parallel.pipeline.schedule import stage_of

WIDTH, ROWS = 8, 4  # each boundary tensor is (ROWS, WIDTH)
DTYPE = torch.float64  # so both runs agree to the fp64 reduction bound (tests/support/numerics.py)


def layers(n_stages: int, seed: int = 0) -> list[nn.Linear]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_stages):
        layer = nn.Linear(WIDTH, WIDTH, dtype=DTYPE)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(WIDTH, WIDTH, generator=gen) / WIDTH**0.5)
            layer.bias.copy_(torch.randn(WIDTH, generator=gen) * 0.1)
        out.append(layer)
    return out


def batch(m: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, ROWS, WIDTH, generator=gen, dtype=DTYPE),
            torch.randn(m, ROWS, WIDTH, generator=gen, dtype=DTYPE))


class LinearStages:
    """The `Stage` of one pipeline rank: its chunks' layers and their saved autograd state."""

    def __init__(self, p: int, v: int, rank: int, m: int, seed: int = 0) -> None:
        self.p, self.v, self.rank, self.m = p, v, rank, m
        every = layers(v * p, seed)
        self.layers = {c: every[stage_of(rank, c, p)] for c in range(v)}
        self.inputs, self.targets = batch(m)
        self.saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def stage(self, chunk: int) -> int:
        return stage_of(self.rank, chunk, self.p)

    def forward(self, mb: int, chunk: int, x: torch.Tensor | None) -> torch.Tensor:
        if x is None:  # stage 0 reads its microbatch; nothing before it needs a gradient
            x = self.inputs[mb]
        else:
            x = x.detach().requires_grad_()
        y = torch.tanh(self.layers[chunk](x))
        if self.stage(chunk) == self.v * self.p - 1:
            y = ((y - self.targets[mb]) ** 2).mean() / self.m
        self.saved[(mb, chunk)] = (x, y)
        return y

    def backward(self, mb: int, chunk: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        x, y = self.saved.pop((mb, chunk))
        y.backward(grad)
        return x.grad if x.requires_grad else None

    def grads(self) -> dict[int, dict[str, torch.Tensor]]:
        return {self.stage(c): {n: prm.grad.clone() for n, prm in layer.named_parameters()}
                for c, layer in self.layers.items()}


def serial(n_stages: int, m: int, seed: int = 0) -> tuple[list[float], dict[int, dict]]:
    """The same stages in one process, microbatch after microbatch: losses and gradients."""
    every = layers(n_stages, seed)
    inputs, targets = batch(m)
    losses = []
    for mb in range(m):
        h = inputs[mb]
        for layer in every:
            h = torch.tanh(layer(h))
        loss = ((h - targets[mb]) ** 2).mean() / m
        loss.backward()
        losses.append(loss.item())
    grads = {s: {n: prm.grad.clone() for n, prm in layer.named_parameters()}
             for s, layer in enumerate(every)}
    return losses, grads
