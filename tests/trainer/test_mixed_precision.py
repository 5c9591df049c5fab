"""bf16 mixed precision on dp 2 x tp 2 x pp 2 (8 MPI ranks): it tracks fp32, learns, keeps fp32
main weights, checkpoints them and resumes bit-exactly.

The worker (`tests.support.bf16_worker`, one ``mpiexec`` run) trains a 2-layer model for 20 steps in
fp32, in bf16, and in bf16 with a bf16 gradient all-reduce, from the same fp32 initial weights.

The tracking tolerance, derived (nothing in it is fitted to a machine), U = 2^-8 the bf16 unit
roundoff:

* K, the bf16 roundings on the longest path from the weights to the loss: per layer the
  attention branch rounds ln1, qkv weight and output, the rope tables and output, the attention
  probabilities and output, proj weight and output and the residual sum (10), the MLP branch
  ln2, fc weight and output, GELU, proj weight and output and the residual sum (7), and TP's
  two row-parallel sums (2): 19 per layer; then the embedding, ln_f, head weight and logits (4).
* Rounding errors are modelled as independent and zero-mean (probabilistic rounding error
  analysis, Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019, Thm 2.4): K of them compound to a
  relative error below λ·√K·U with probability >= 1 - 2K·exp(-λ²/2); λ = 5 (< 1e-3 for the
  worst K here). Applied to the loss: the forward term λ·√K·U·loss.
* The gradient passes the K forward and K backward roundings (2K, plus 2 for a bf16
  all-reduce: round before and after the sum): relative error r = λ·√(2K)·U. Adam's update is
  at most lr per element (Kingma & Ba 2015, §2.1, as 1 - β1 < √(1 - β2)), and m/√v moves by at
  most 2r relative when m and v move by r and 2r, so the weights drift apart by at most
  Σ_{s<t} 2·r·lr_s per element. To first order the loss moves by g·δθ; with the drift
  independent of the direction of g that is within λ·‖g_t‖·drift (‖g_t‖ the fp32 run's
  gradient norm): the trajectory term.

Over the 20 steps this is 0.5 to 1.2 nats, while the loss falls by 2.5: a run that does not
train, or whose bf16 weights are not updated from the fp32 main weights, leaves it by step 4.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.support.bf16_worker import GPT as MODEL
from tests.support.bf16_worker import HALF, STEPS
from tests.support.mpi_runs import world_run
from tests.support.numerics import bf16_tracking
from tests.support.saved import same_states, saved_state, slice_of
from trainer.checkpoint.pieces import assemble
from trainer.config.options import parse_args
from trainer.errors import ConfigError
from trainer.model.config import GPTConfig
from trainer.model.gpt import GPT
from trainer.optim.mixed_precision import MainParams, model_dtype
from trainer.optim.optimizer import build_optimizer

WORKER = "tests.support.bf16_worker:run"
K = 19 * MODEL["n_layer"] + 4


def ranks() -> list[dict]:
    return world_run(WORKER, 8).ranks


def tolerance(extra_grad_roundings: int = 0) -> list[float]:
    """The tracking tolerance of every step (see the module docstring)."""
    return bf16_tracking(ranks()[0]["fp32"], k=K, extra_grad=extra_grad_roundings)[0]


@pytest.mark.parametrize("run,extra", [("bf16", 0), ("bf16_reduce", 2)])
def test_a_bf16_run_of_dp2_tp2_pp2_tracks_the_fp32_run_for_20_steps(run: str,
                                                                    extra: int) -> None:
    tol = tolerance(extra)
    for r in ranks():
        fp32, bf16 = r["fp32"]["losses"], r[run]["losses"]
        for step, (want, got, atol) in enumerate(zip(fp32, bf16, tol, strict=True), 1):
            assert abs(got - want) <= atol, (run, r["rank"], step, got, want, atol)


def test_the_bf16_loss_falls_by_more_than_the_tracking_tolerance() -> None:
    losses = ranks()[0]["bf16"]["losses"]
    assert sum(losses[-5:]) / 5 < losses[0] - max(tolerance())


def test_a_bf16_gradient_all_reduce_changes_the_run() -> None:
    assert ranks()[0]["bf16_reduce"]["losses"] != ranks()[0]["bf16"]["losses"]


def test_the_model_runs_in_bf16_on_fp32_main_weights_it_is_the_rounding_of() -> None:
    for r in ranks():
        model, main = r["bf16"]["model"], r["bf16"]["main"]
        assert model.keys() == main.keys()
        rounded_away = 0
        for name, weight in model.items():
            assert weight.dtype == torch.bfloat16 and main[name].dtype == torch.float32, name
            assert torch.equal(weight, main[name].to(torch.bfloat16)), name
            rounded_away += int((main[name].to(torch.bfloat16).float() != main[name]).sum())
        assert rounded_away > 0  # the main weights hold more than bf16 can


def test_the_checkpoint_holds_the_fp32_main_weights() -> None:
    saved = assemble(Path(ranks()[0]["bf16"]["checkpoint"]))
    assert all(t.dtype == torch.float32 for t in saved.values())
    for r in ranks():
        for main, placement in r["bf16"]["held"]:
            assert torch.equal(slice_of(saved[placement.name], placement), main.view(-1)), \
                (r["bf16"]["coords"], placement.name)


def test_a_resumed_bf16_run_is_bit_identical_to_an_uninterrupted_one() -> None:
    for r in ranks():
        assert r["resumed"]["start"] == HALF
        assert r["resumed"]["losses"] == r["bf16"]["losses"]  # exact, not just close
    resumed = Path(ranks()[0]["resumed"]["checkpoint"])
    assert resumed.name == f"step-{STEPS}"
    assert same_states(saved_state(Path(ranks()[0]["bf16"]["checkpoint"])),
                       saved_state(resumed)) == []


def test_a_bf16_checkpoint_resumes_in_fp32_from_its_main_weights() -> None:
    for r in ranks():
        assert r["switched"]["start"] == STEPS and len(r["switched"]["losses"]) == 1
        assert math.isfinite(r["switched"]["losses"][0])


# -- without MPI ------------------------------------------------------------------------------

def test_precision_auto_is_bf16_on_cuda_and_keeps_the_built_dtype_on_cpu() -> None:
    assert model_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert model_dtype("auto", torch.device("cpu")) is None
    assert model_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    assert model_dtype("fp32", torch.device("cuda", 0)) is None


def test_an_unknown_precision_or_reduce_dtype_is_refused_naming_the_flag() -> None:
    cfg = parse_args(["--precision", "bf16", "--grad-reduce-dtype", "bf16"])
    assert cfg.optimizer.precision == "bf16"
    with pytest.raises(ConfigError, match=r"\[--precision fp16\]: must be one of auto, fp32"):
        parse_args(["--precision", "fp16"])
    with pytest.raises(ConfigError,
                       match=r"\[--grad-reduce-dtype fp16\]: must be one of fp32, bf16"):
        parse_args(["--grad-reduce-dtype", "fp16"])


def test_main_params_step_exactly_as_fp32_adamw_and_publish_their_rounding() -> None:
    """In memory: the same fp32 gradients (set as DP's ``main_grad``) on a bf16 model's main
    copies and on an fp32 model give bit-identical fp32 weights after AdamW steps."""
    cfg = GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8)
    fp32, mixed = GPT(cfg, seed=3), GPT(cfg, seed=3)
    reference = build_optimizer(fp32, lr=1e-2, weight_decay=0.1)
    main = MainParams.take(mixed, build_optimizer(mixed, lr=1e-2, weight_decay=0.1),
                           torch.bfloat16, lambda ps: build_optimizer(ps, lr=1e-2,
                                                                      weight_decay=0.1))
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p, q in zip(fp32.parameters(), main.params, strict=True):
            p.grad = torch.randn(p.shape, generator=gen)
            q.main_grad = p.grad.clone()
        reference.step()
        main.grads()
        main.optimizer.step()
        main.publish()
    state = main.state_dict()
    assert torch.equal(state["head.weight"], state["tok_emb.weight"])  # tied: one main copy
    for name, p in fp32.named_parameters():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], p), name
        model_p = mixed.get_parameter(name)
        assert model_p.dtype == torch.bfloat16 and torch.equal(model_p, p.to(torch.bfloat16))
