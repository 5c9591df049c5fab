"""The bytes one rank sends per optimizer step in each kind of group (the planner's
communication, counted as `trainer.plan.traffic` counts a run's: ring algorithms).

    dp   the gradients' reduction over dp x cp (the copies of a weight): a ring all-reduce once
         per step; under ZeRO-1 a reduce-scatter once per step and the all-gather of the
         stepped parameters; under ZeRO-2 the reduce-scatter every microbatch
         (`trainer.parallel.zero.grad_shards`); under ZeRO-3 every microbatch the
         reduce-scatter and two all-gathers of every block, one of the rest (the root, gathered
         through forward and backward: `trainer.parallel.zero.units`), and under hybrid
         sharding the shards' all-reduce across the groups once per step
    tp   the tensor-parallel regions' all-reduces (all-gathers and reduce-scatters under
         sequence parallelism) and the vocabulary-parallel loss
    pp   activations forward and gradients back across stage boundaries; the tied embedding
    ep   the experts' dispatch and combine all-to-all of the rows the run's first step
         routes to the other members (`trainer.plan.routing`)
    cp   the K/V exchange of context-parallel attention, per layer
         (`trainer.parallel.context.plan.exchange_sends`)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from trainer.config.options import TrainConfig
from trainer.parallel.context.plan import exchange_sends
from trainer.plan.routing import sent_share
from trainer.plan.shapes import stage_params


@dataclass(frozen=True)
class Comm:
    """Bytes one rank sends per optimizer step, by group."""

    dp: float
    tp: float
    pp: float
    ep: float
    cp: float = 0.0

    @property
    def total(self) -> float:
        return self.dp + self.tp + self.pp + self.ep + self.cp


def ring(size: int) -> float:
    """The share of a collective's bytes one member sends under a ring algorithm."""
    return (size - 1) / size if size > 1 else 0.0


def unit_sizes(cfg: TrainConfig) -> tuple[int, int]:
    """(a block's, the rest's) parameters of one tp rank: the trainer's models of one and of
    two blocks on the meta device (`trainer.plan.shapes.stage_params`)."""
    one, two = (stage_params(replace(cfg.gpt, n_layer=k), tp=cfg.parallel.tp, pp=1)[0].dense
                for k in (1, 2))
    return two - one, 2 * one - two


def reduction(cfg: TrainConfig, n: int, size: int, *, blocks: int, grad_width: int,
              width: int) -> float:
    """Bytes one rank sends to reduce the gradients of its ``n`` parameters over their
    ``size`` copies (``blocks`` of them whole transformer blocks, for ZeRO-3's gathers), and
    under ZeRO to gather the parameters back (module docstring)."""
    zero, m = cfg.optimizer.zero, cfg.parallel.microbatches
    if not zero:
        return 2 * ring(size) * grad_width * n
    if zero < 3:
        scatters = m if zero == 2 else 1
        return ring(size) * (scatters * grad_width * n + width * n)
    shard = cfg.parallel.zero_shard_size or size
    gathered = n + blocks  # the blocks twice (forward, backward), the rest once
    across = 2 * ring(size // shard) * grad_width * n / shard
    return m * ring(shard) * (grad_width * n + width * gathered) + across


def pp_sends(cfg: TrainConfig) -> int:
    """The most stage boundaries one pipeline rank sends across per microbatch: an activation
    forward from every chunk but the last stage, a gradient back from every chunk but the
    first."""
    par = cfg.parallel
    if par.pp == 1:
        return 0
    stages = len(cfg.stage_layers)
    v = stages // par.pp
    return max(sum((c * par.pp + r < stages - 1) + (c * par.pp + r > 0) for c in range(v))
               for r in range(par.pp))


def comm(cfg: TrainConfig, *, bf16: bool, steps: tuple[int, ...] = (1,)) -> Comm:
    """Bytes the busiest rank sends per step in each kind of group (module docstring), mean
    over the run's ``steps`` (the experts' all-to-all routes each step's data)."""
    par, gpt = cfg.parallel, cfg.gpt
    width = 2 if bf16 else 4
    v = par.virtual_stages if par.schedule == "interleaved" else 1
    stages = stage_params(gpt, tp=par.tp, pp=par.pp, v=v)
    grad_width = 4 if par.grad_reduce_dtype == "fp32" else 2
    layers = max(cfg.stage_layers) if par.pp > 1 else gpt.n_layer
    block = unit_sizes(cfg)[0] if cfg.optimizer.zero == 3 else 0
    # Experts are replicated over dp / ep ranks only (`trainer.parallel.data.split`); every
    # weight over the cp ranks too.
    dp = max(reduction(cfg, s.dense, par.dp * par.cp, blocks=block * layers,
                       grad_width=grad_width, width=width)
             + reduction(cfg, s.expert // par.ep, par.dp // par.ep * par.cp, blocks=0,
                         grad_width=grad_width, width=width) for s in stages)
    tokens = cfg.micro_batch * gpt.seq_len // par.cp
    act = tokens * gpt.d_model * width
    # Per block and microbatch, two all-reduces of the activations forward (attention and MLP
    # outputs) and two backward (their inputs' gradients), two more under full recomputation;
    # the embedding's forward and the head's input gradient add one each.
    per_block = 4 + (2 if par.recompute == "full" else 0)
    # Under sequence parallelism the all-reduces are all-gathers and reduce-scatters (half the
    # bytes each, as many again) and each column-parallel linear (two per block, the head)
    # gathers its input once more in backward instead of keeping it (`parallel.tensor.mappings`).
    regather = (2 * layers + 1) if par.sequence_parallel else 0
    # The vocabulary-parallel loss: three all-reduces of one fp32 number per token.
    loss = 3 * tokens * 4 * 2 if par.tp > 1 else 0
    tp = par.microbatches * ring(par.tp) * ((layers * per_block + 2) * 2 * act
                                            + regather * act + loss)
    pp: float = par.microbatches * pp_sends(cfg) * act
    if par.pp > 1 and gpt.tied:  # the tied embedding's gradient, summed over the end stages
        pp += 2 * ring(2) * grad_width * gpt.vocab_rows * gpt.d_model / par.tp
    moe_layers = len(range(0, layers, gpt.moe.every)) if gpt.moe.experts else 0
    # Dispatch and combine, forward and backward: the kept rows (at most the capacity)
    # that go to the other members of ep and come back from them, as the run's ``steps``
    # route them (`trainer.plan.routing`: balanced where that cannot be measured).
    share = sent_share(cfg, steps) if moe_layers and par.ep > 1 else 0.0
    ep = par.microbatches * moe_layers * 4 * share * act
    # This rank's [K; V] (its tp share of the key/value heads), and their gradients in fp32.
    kv = 2 * tokens * max(1, gpt.kv_heads // par.tp) * gpt.head_dim
    forward, backward = exchange_sends(par.cp, par.cp_comm, kv_bytes=kv * width,
                                       grad_bytes=kv * 4)
    again = forward if par.recompute != "none" else 0  # re-run with the attention core
    cp = par.microbatches * layers * (forward + backward + again)
    return Comm(dp=dp, tp=tp, pp=pp, ep=ep, cp=cp)
