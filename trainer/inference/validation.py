"""The validation loss of a run, on every layout (DP, TP, PP), logged by rank 0.

The data is the held-out split (`trainer.data.corpus`: the last ``--val-fraction`` of the bytes,
never trained on): ``--eval-batches`` batches of ``--global-batch`` windows, the same windows at
every evaluation (batch k is drawn from (seed, k)), so the curve moves only because the model does.
Each DP rank evaluates its slice of every batch in the run's microbatches, exactly as a step
trains on it, with dropout off and no gradients; the loss is the mean over batches of the batch
mean, averaged over DP like the training loss, so any layout computes the serial model's value
up to fp32 rounding.

Under TP the forward runs as in training (vocab-parallel loss, no gathered logits). Under PP
the stages run forward only, one after the other: the rank of stage s receives the activation
from the rank of stage s-1, runs its layers and sends to the rank of stage s+1 (with virtual
chunks, stage s is chunk s // p of rank s % p); the last stage computes the loss, which is
broadcast over the pipeline so that global rank 0 (first stage) logs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.comm.protocol import Communicator, ReduceOp
from trainer.data.batches import ShardedBatches
from trainer.data.corpus import Corpus
from trainer.model.gpt import GPT
from trainer.pipeline.partition import StageLayout


@dataclass
class Validation:
    """What one rank needs to compute the validation loss of its model."""

    batches: ShardedBatches
    """This DP rank's slices of the validation batches (``validation=True``)."""
    model: GPT
    dp: Communicator
    pp: Communicator | None = None
    layout: StageLayout | None = None
    """This rank's pipeline stages (with ``pp``), else None."""

    @classmethod
    def of(cls, corpus: Corpus, train: ShardedBatches, model: GPT, dp: Communicator,
           pp: Communicator | None = None, layout: StageLayout | None = None) -> Validation:
        """The validation of a run whose training batches are ``train`` (same plan, seed,
        DP rank and device)."""
        batches = ShardedBatches(corpus, seq_len=train.seq_len, plan=train.plan, seed=train.seed,
                                 dp_rank=train.dp_rank, device=train.device, validation=True)
        return cls(batches, model, dp, pp, layout)

    @torch.no_grad()
    def loss(self, num_batches: int) -> float:
        """Mean loss over ``num_batches`` validation batches, on every rank (collective over DP
        and PP, and TP inside the model)."""
        was_training = self.model.training
        self.model.eval()
        try:
            total = torch.zeros((), device=self.batches.device)
            for k in range(num_batches):
                micro = self.batches.microbatches(k)
                for x, y in micro:
                    part = self._forward(x, y)
                    if part is not None:
                        total += part.float() / (len(micro) * num_batches)
        finally:
            self.model.train(was_training)
        total = total.reshape(1)
        self.dp.all_reduce(total, ReduceOp.AVG)
        if self.pp is not None:
            self.pp.broadcast(total, self.pp.size - 1)
        return float(total)

    def _forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """The microbatch's mean loss (on the pipeline's last stage; None on other stages)."""
        if self.layout is None or self.pp is None:
            return self.model.loss(x, y)
        model, layout, comm = self.model, self.layout, self.pp
        h = torch.empty(0)
        for stage in range(comm.rank, layout.num_stages, layout.p):
            chunk = stage // layout.p
            if layout.is_first(chunk):
                h = model.emb_drop(model.tok_emb(x))
            else:
                h = torch.empty((*x.shape, model.cfg.d_model), device=x.device,
                                dtype=next(model.parameters()).dtype)
                comm.recv(h, (stage - 1) % layout.p)
            for i in layout.layers(chunk):
                h = model.blocks[str(i)](h, model.rope_cos, model.rope_sin)
            if layout.is_last(chunk):
                return model.criterion(model.head(model.ln_f(h)).flatten(0, 1), y.flatten())
            comm.send(h.contiguous(), (stage + 1) % layout.p)
        return None
