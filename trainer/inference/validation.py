"""The validation loss of a run, on every layout (DP, TP, PP), logged by rank 0.

The data is the held-out split (`trainer.data.corpus`: the last ``--val-fraction`` of the bytes,
never trained on): ``--eval-batches`` batches of ``--global-batch`` windows, the same windows at
every evaluation (batch k is drawn from (seed, k)), so the curve moves only because the model does.
Each DP rank evaluates its slice of every batch in the run's microbatches, exactly as a step
trains on it, with dropout off and no gradients; the loss is the mean over batches of the batch
mean, averaged over DP like the training loss, so any layout computes the serial model's value
up to fp32 rounding.

Under TP the forward runs as in training (vocab-parallel loss, no gathered logits). Under PP
the stages run forward only, one after the other (the pipeline body's ``eval_loss``,
`trainer.training.pipeline_step`); the last stage computes the loss, which is broadcast over
the pipeline so that global rank 0 (first stage) logs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from trainer.comm.protocol import Communicator, ReduceOp
from trainer.data.batches import ShardedBatches
from trainer.data.corpus import Corpus
from trainer.data.sources import TokenData, make_batches
from trainer.data.token_batches import TokenBatches


@dataclass
class Validation:
    """What one rank needs to compute the validation loss of its model."""

    batches: ShardedBatches | TokenBatches
    """This DP rank's slices of the validation batches (``validation=True``)."""
    model: nn.Module
    body: EvalForward
    """Runs a microbatch's forward (the run's step body: `trainer.training.body`)."""
    dp: Communicator
    """The ranks the loss is averaged over: data- and context-parallel (``dp_cp``)."""
    pp: Communicator
    """The pipeline's group (of one rank without a pipeline): the last stage's loss goes to
    every stage."""

    @classmethod
    def of(cls, corpus: Corpus | TokenData, train: ShardedBatches | TokenBatches,
           model: nn.Module, body: EvalForward, dp: Communicator, pp: Communicator
           ) -> Validation:
        """The validation of a run whose training batches are ``train`` (same plan, seed,
        DP rank and device)."""
        batches = make_batches(corpus, seq_len=train.seq_len, plan=train.plan, seed=train.seed,
                               dp_rank=train.dp_rank, device=train.device, validation=True,
                               reporter=not isinstance(train, TokenBatches) or train.reporter,
                               keep=train.keep,
                               documents=isinstance(train, TokenBatches) and
                               train.eos_id is not None)
        return cls(batches, model, body, dp, pp)

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
                for batch in micro:
                    part = self.body.eval_loss(*batch)
                    if part is not None:
                        total += part.float() / (len(micro) * num_batches)
        finally:
            self.model.train(was_training)
        total = total.reshape(1)
        self.dp.all_reduce(total, ReduceOp.AVG)
        self.pp.broadcast(total, self.pp.size - 1)
        return float(total)


class EvalForward(Protocol):
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor, *docs: torch.Tensor
                  ) -> torch.Tensor | None: ...
