"""The DLRM-style click model: bottom MLP, sharded embeddings, dot interactions, top MLP.

The dense part (`DenseTower`: bottom and top MLPs) is an ordinary ``nn.Module``, replicated
and trained data-parallel. The F categorical features share one `ShardedEmbedding` (one
all-to-all per lookup for all features, as SOK fuses them): feature f's key k is global key
``offset[f] + k`` in identity mode (offsets are the running sums of the vocabularies) and
``k * 64 + f`` in hash mode (raw keys, e.g. Criteo's 32-bit hashes, stay distinct per feature).
The interaction is DLRM's: the pairwise dot products of the F + 1 vectors (bottom output and
every embedding), strictly below the diagonal, concatenated with the bottom output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from trainer.comm.protocol import Communicator
from trainer.sparse import ShardedEmbedding

_HASH_FEATURES = 64  # features a hash-mode table can tell apart (k * 64 + f)


@dataclass(frozen=True, kw_only=True)
class DLRMConfig:
    vocab: tuple[int, ...]
    """Keys per categorical feature (identity mode); ignored for the table size in hash mode."""
    dense_features: int = 13
    dim: int = 16
    bottom: tuple[int, ...] = (64,)
    top: tuple[int, ...] = (64,)
    hash_capacity: int = 0
    """Rows per rank of a hash-mode table (0: identity mode, sum(vocab) rows in all)."""

    @property
    def features(self) -> int:
        return len(self.vocab)


def _mlp(sizes: list[int], *, last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:], strict=False)):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DenseTower(nn.Module):
    """Bottom MLP (dense features -> dim), interaction, top MLP (-> one logit)."""

    def __init__(self, cfg: DLRMConfig, *, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)  # the same initial weights on every rank and in the reference
        pairs = (cfg.features + 1) * cfg.features // 2
        self.bottom = _mlp([cfg.dense_features, *cfg.bottom, cfg.dim], last_relu=True)
        self.top = _mlp([cfg.dim + pairs, *cfg.top, 1], last_relu=False)
        rows, cols = torch.tril_indices(cfg.features + 1, cfg.features + 1, offset=-1)
        self.register_buffer("pair_rows", rows, persistent=False)
        self.register_buffer("pair_cols", cols, persistent=False)

    def forward(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """Logits (B,) from dense features (B, 13) and embeddings (B, F, dim)."""
        x = self.bottom(dense)
        vectors = torch.cat([x.unsqueeze(1), embedded], dim=1)
        pairs = cast(torch.Tensor, self.pair_rows), cast(torch.Tensor, self.pair_cols)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, pairs[0], pairs[1]]
        logits: torch.Tensor = self.top(torch.cat([x, dots], dim=1))
        return logits.squeeze(1)


def global_keys(cfg: DLRMConfig, sparse: torch.Tensor) -> torch.Tensor:
    """The table keys of a (B, F) batch of per-feature keys."""
    if cfg.hash_capacity:
        return sparse * _HASH_FEATURES + torch.arange(cfg.features, device=sparse.device)
    offsets = torch.tensor((0, *cfg.vocab[:-1]), device=sparse.device).cumsum(0)
    return sparse + offsets


class DLRM:
    """The whole model on one rank: the replicated dense tower and this rank's table shard."""

    def __init__(self, cfg: DLRMConfig, comm: Communicator, *, seed: int,
                 device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> None:
        self.cfg = cfg
        self.dense = DenseTower(cfg, seed=seed).to(device=device, dtype=dtype)
        # Each rank's loss is the mean of its 1/G of the batch; 1/G makes the table's gradient
        # the global batch's mean, as DP's 1/dp does for the dense part.
        self.table = ShardedEmbedding(
            comm, dim=cfg.dim, num_rows=0 if cfg.hash_capacity else sum(cfg.vocab),
            capacity=cfg.hash_capacity, seed=seed, grad_scale=1.0 / comm.size, dtype=dtype,
            device=device, name="DLRM embedding")

    def logits(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        keys = global_keys(self.cfg, sparse)
        embedded = self.table(keys.reshape(-1, 1))  # one bag per (row, feature)
        embedded = embedded.view(len(sparse), self.cfg.features, self.cfg.dim)
        logits: torch.Tensor = self.dense(dense, embedded)
        return logits

    def train(self, mode: bool = True) -> None:
        self.dense.train(mode)
        self.table.train(mode)
