"""Llama training tokens/s on one CPU process: dtrain against transformers and torchtitan.

    python -m bench.llama_step [--sizes tiny,100m] [--steps 3] [--reps 3]

Three sides train the same shape (layers, width, heads, key/value heads, MLP width, vocabulary,
sequence length, batch; the rows show each side's parameter count), fp32, AdamW, untied head,
gradient norm clipped to the trainer's default (1.0, as torchtitan's and Hugging Face's trainers
do too), in the same process and thread count:

* ``dtrain``: the trainer's own step on the Llama (``build_run``/``run_step``: what ``python -m
  trainer.train --arch llama`` runs, DP gradient buffer, clipping and guard included);
* ``transformers``: ``LlamaForCausalLM`` (sdpa attention), logits -> cross entropy -> clip;
* ``torchtitan``: its Llama 3 model (``torchtitan.models.llama3``, model code only; setup.cfg's
  ``bench`` extra, installed by ``make bench``), tokens -> logits -> cross entropy -> clip.

After one warm-up step each, the sides take ``reps`` runs of ``steps`` timed steps in turn, one
step each, their order rotated every round, so drifting load on a shared machine hits them alike;
each run is its own rows (``run`` 1..reps) with its median step times and ratios, dtrain's tokens/s
over each peer's (target, issue 40: >= 1.0 at every size, in every run), by wall time and by the
CPU time of the step's thread (``dtrain_over_this_cpu``: the peer's CPU time over dtrain's). A
side whose package is missing is a row saying so.

dtrain's fp32 linears on a CPU multiply through oneDNN (`trainer.model.linear`), the peers'
through torch's ``aten::mm`` (MKL); ``--same-kernels`` gives the peers' ``nn.Linear`` layers
dtrain's kernel too, for the comparison at equal matrix-product kernels.
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import with_dtrain_linears
from trainer.config.sections import OptimizerSection
from trainer.model.config import GPTConfig
from trainer.model.llama_config import LlamaShape

Row = dict[str, Any]
CLIP = OptimizerSection().grad_clip


@dataclass(frozen=True)
class Size:
    cfg: GPTConfig
    batch: int


SIZES = {
    # llama-tiny's shape with a 2,048-token vocabulary (a tokenizer's, not bytes).
    "tiny": Size(GPTConfig(arch="llama", norm="rmsnorm", tied=False, vocab_size=2048,
                           n_layer=2, n_head=8, d_model=64, seq_len=64,
                           llama=LlamaShape(n_kv_head=2, multiple_of=16)), batch=16),
    # ~100M parameters: 12 layers of 768 with 4 key/value heads, a 16,384-token vocabulary.
    "100m": Size(GPTConfig(arch="llama", norm="rmsnorm", tied=False, vocab_size=16384,
                           n_layer=12, n_head=12, d_model=768, seq_len=256,
                           llama=LlamaShape(n_kv_head=4, multiple_of=256)), batch=4),
}

Step = Callable[[torch.Tensor, torch.Tensor], object]
Side = tuple[Step, int]
"""A side's training step and its model's parameter count (the same on every side)."""
SIZES_BATCH = {size.cfg: size.batch for size in SIZES.values()}


def _trainer(model: torch.nn.Module, forward: Callable[[torch.Tensor], torch.Tensor]) -> Side:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = forward(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, sum(p.numel() for p in model.parameters())


def dtrain_side(cfg: GPTConfig) -> Side:
    """The trainer's own step (``build_run``/``run_step`` on a world of one rank, as ``python
    -m trainer.train`` runs it: DP gradient buffer, clipping, the guard, fp32), on the
    byte corpus (ids below 256 of the model's vocabulary: the same matmuls)."""
    from trainer.comm.bootstrap import init
    from trainer.comm.mesh import Mesh
    from trainer.comm.topology import MeshShape
    from trainer.config.options import make_config
    from trainer.training.run import build_run
    from trainer.training.step import run_step

    world = init(backend="mpi")
    train = {"steps": 1_000_000, "global_batch": SIZES_BATCH[cfg], "dp": 1, "precision": "fp32",
             "eval_every": 0, "warmup_steps": 10, "data_cap_mb": 2.0,
             "run_dir": tempfile.mkdtemp(prefix="dtrain-bench-llama-")}
    atexit.register(shutil.rmtree, train["run_dir"], True)  # the bench saves nothing there
    run = build_run(make_config(train, cfg.to_dict()), Mesh.build(world.comm, MeshShape(),
                                                                   world.device))
    steps = iter(range(1, 10**9))
    return (lambda x, y: run_step(run, next(steps))), run.model.num_params()


def transformers_side(cfg: GPTConfig, same_kernels: bool = False) -> Side:
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    hf = HFConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                  intermediate_size=cfg.hidden, num_hidden_layers=cfg.n_layer,
                  num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads,
                  max_position_embeddings=cfg.seq_len, rms_norm_eps=cfg.norm_eps,
                  tie_word_embeddings=False, rope_theta=cfg.rope_theta,
                  attn_implementation="sdpa")
    model = LlamaForCausalLM(hf).train()
    if same_kernels:
        with_dtrain_linears(model)
    return _trainer(model, lambda x: model(input_ids=x, use_cache=False).logits)


def torchtitan_side(cfg: GPTConfig, same_kernels: bool = False) -> Side:
    # torchtitan's own builders with its SDPA attention class: its language-model presets now
    # pick flex or varlen attention, which need compilation or CUDA; SDPA is its eager path.
    from torchtitan.models import llama3 as tt
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config

    d = cfg.d_model
    rope = ComplexRoPE.Config(dim=cfg.head_dim, max_seq_len=cfg.seq_len, theta=cfg.rope_theta)
    layers = [tt.Llama3TransformerBlock.Config(
        attention_norm=RMSNorm.Config(normalized_shape=d, param_init=tt._NORM_INIT),
        ffn_norm=RMSNorm.Config(normalized_shape=d, param_init=tt._NORM_INIT),
        attention=make_gqa_config(dim=d, n_heads=cfg.n_head, n_kv_heads=cfg.kv_heads,
                                  wqkv_param_init=tt._LINEAR_INIT,
                                  wo_param_init=tt._depth_init(i),
                                  inner_attention=ScaledDotProductAttention.Config(),
                                  fuse_qkv=True, rope=rope),
        feed_forward=make_ffn_config(dim=d, hidden_dim=cfg.hidden,
                                     w1_param_init=tt._LINEAR_INIT,
                                     w2w3_param_init=tt._depth_init(i)))
        for i in range(cfg.n_layer)]
    spec = tt.Llama3Model.Config(
        dim=d, vocab_size=cfg.vocab_size,
        tok_embeddings=Embedding.Config(num_embeddings=cfg.vocab_size, embedding_dim=d,
                                        param_init=tt._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=d, param_init=tt._NORM_INIT),
        lm_head=Linear.Config(in_features=d, out_features=cfg.vocab_size,
                              param_init=tt._output_linear_init(d)),
        layers=layers)
    model = spec.build()
    model.init_states(buffer_device=torch.device("cpu"))
    model.train()
    if same_kernels:
        with_dtrain_linears(model)
    return _trainer(model, model)


SIDES: dict[str, Callable[..., Side]] = {
    "dtrain": dtrain_side, "transformers": transformers_side, "torchtitan": torchtitan_side}


def measure(size: str, *, steps: int, reps: int, same_kernels: bool = False) -> list[Row]:
    spec = SIZES[size]
    cfg, batch = spec.cfg, spec.batch
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen)
    x, y = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    built: dict[str, Step] = {}
    params: dict[str, int] = {}
    missing: dict[str, str] = {}
    for name, make in SIDES.items():
        torch.manual_seed(0)
        try:
            built[name], params[name] = make(cfg, same_kernels) if name != "dtrain" else \
                make(cfg)
        except ImportError as err:
            missing[name] = f"not installed ({err.name})"
        built.get(name, lambda *_: None)(x, y)  # warm-up step
    order = list(built)
    rows: list[Row] = []
    for run_no in range(1, reps + 1):
        times: dict[str, list[float]] = {name: [] for name in built}
        cpu: dict[str, list[float]] = {name: [] for name in built}
        for k in range(steps):  # one step of each side in turn: drifting load hits all
            for name in order[k % len(order):] + order[:k % len(order)]:
                start, thread = time.perf_counter(), time.thread_time()
                built[name](x, y)
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.thread_time() - thread)
        rows += _run_rows(size, spec, run_no, (times, cpu), params, missing, same_kernels)
    return rows


def _run_rows(size: str, spec: Size, run_no: int,
              timed: tuple[dict[str, list[float]], dict[str, list[float]]],
              params: dict[str, int], missing: dict[str, str], same_kernels: bool
              ) -> list[Row]:
    """One run's rows: each side's median step (wall, and CPU time of the step's thread,
    which a loaded machine inflates far less), and dtrain's tokens/s over each peer's."""
    times, cpu = timed
    tokens = spec.batch * spec.cfg.seq_len
    rows: list[Row] = []
    for name in SIDES:
        if name in missing:
            rows.append({"size": size, "run": run_no, "side": name, "note": missing[name]})
            continue
        step_s = statistics.median(times[name])
        rows.append({"size": size, "run": run_no, "side": name, "batch": spec.batch,
                     "seq_len": spec.cfg.seq_len, "step_ms": round(step_s * 1e3, 1),
                     "cpu_ms": round(statistics.median(cpu[name]) * 1e3, 1),
                     "tokens_per_s": round(tokens / step_s), "steps": len(times[name]),
                     "threads": torch.get_num_threads(), "params": params[name],
                     "peer_kernels": "dtrain's" if same_kernels and name != "dtrain"
                     else "own"})
    ours, ours_cpu = rows[0].get("tokens_per_s"), rows[0].get("cpu_ms")
    for row in rows[1:]:
        if ours and row.get("tokens_per_s"):
            row["dtrain_over_this"] = round(ours / row["tokens_per_s"], 3)
            row["dtrain_over_this_cpu"] = round(row["cpu_ms"] / ours_cpu, 3)
    return rows


def run(sizes: tuple[str, ...] = ("tiny", "100m"), steps: int = 3, reps: int = 3,
        same_kernels: bool = False) -> list[Row]:
    return [row for size in sizes
            for row in measure(size, steps=steps, reps=reps, same_kernels=same_kernels)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,100m")
    parser.add_argument("--steps", type=int, default=3, help="timed steps of each side a run")
    parser.add_argument("--reps", type=int, default=3, help="runs of each size, each reported")
    parser.add_argument("--same-kernels", action="store_true",
                        help="the peers' nn.Linear layers multiply through dtrain's kernel")
    args = parser.parse_args()
    for row in run(tuple(args.sizes.split(",")), args.steps, args.reps, args.same_kernels):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
