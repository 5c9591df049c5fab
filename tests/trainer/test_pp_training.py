"""Pipeline-parallel training equals the single-device model, for every schedule and for 3-D.

The worker (`tests.support.pp_training_workers.worker`, one ``mpiexec`` run per world size 2, 4
and 8)
trains every case of `tests.support.pp_training_workers.cases` with the trainer's own
``build_run``/``train_step``: GPipe, 1F1B and interleaved 1F1B (v = 2) at pp 2 and pp 4, an
untied model with a hand-given layer split, dp x pp, tp x pp, and dp 2 x tp 2 x pp 2 on 8
ranks (oversubscribed). The reference is the plain model in this process with the whole global
batch in the same microbatches and torch's ``clip_grad_norm_``. Both sides run in fp64, and a
pipeline changes only the order of sums (the tied embedding's two gradient halves are added once
at the end instead of per microbatch; DP and TP add their own reorderings), so the tolerances
are the fp64 bounds of tests/support/numerics.py, as in tests/trainer/test_tp_training.py: losses
to the
reduction bound plus the first-order effect of rounded updates, the first step's gradient norm
to the reduction bound, every parameter to the reduction bound carried through Adam. Every case
clips, so a wrong norm at a later step fails the parameter test. A wrong stage split, a missing
gradient reduction or an unsynchronised tied copy moves thousands of elements by O(lr) = 3e-3.

Then checkpoints through ``trainer.train.train`` at pp 2 and at 2 x 2 x 2: every rank writes a
share, a resume bit-identical to the uninterrupted run, a resume at pp 1, and the timeline
files. The pure parts (layer partition, stage models, config checks) are tested
without MPI at the end.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.support.mpi_runs import world_run
from tests.support.numerics import (
    assert_within_order,
    f64,
    float64,
    reduction_rtol,
)
from tests.support.pp_training_workers.cases import (
    CASES,
    CHECKPOINT_CASE,
    STEPS,
    WORKER,
    Case,
    case,
)
from tests.support.pp_training_workers.cases import serial_reference as serial
from tests.support.saved import slice_of
from tests.support.serial_reference import bounds
from trainer.checkpoint.pieces import assemble
from trainer.config.options import parse_args
from trainer.errors import ConfigError
from trainer.model.config import GPTConfig
from trainer.model.gpt import GPT
from trainer.parallel.pipeline.partition import StageLayout, balanced_counts, describe, stage_counts
from trainer.parallel.pipeline.stages import GPTStage, build_stage_model

TOKENS = 8 * 16 + 32  # the largest global batch x seq_len, + d_model: the longest sum
RTOL = reduction_rtol(TOKENS)
LR = 3e-3  # the cases' lr: the size of one Adam step
ALL = [c for cases in CASES.values() for c in cases]


def ranks_of(c: Case) -> list[dict]:
    return [r[c.name] for r in world_run(WORKER, c.world).ranks]


def merged_params(c: Case) -> dict[str, torch.Tensor]:
    """DP replica 0's parameters (TP already re-assembled), every stage's, by name; a name
    held by two pipeline ranks (only the tied copy may be) fails."""
    merged: dict[str, torch.Tensor] = {}
    for r in ranks_of(c):
        tp, dp, _ = r["coords"]
        if tp == 0 and dp == 0:
            clash = merged.keys() & r["params"].keys()
            assert not clash, f"{c.name}: held by two stages: {sorted(clash)}"
            merged.update(r["params"])
    return merged


@pytest.mark.parametrize("c", ALL, ids=lambda c: c.name)
def test_losses_and_gradient_norms_match_the_single_device_model(c: Case) -> None:
    ref = serial(c)
    tol = bounds(ref, steps=STEPS, lr=LR, n_terms=TOKENS)
    for r in ranks_of(c):  # every rank reports the step's loss and global norm
        torch.testing.assert_close(f64(r["losses"]),
                                   f64(ref["losses"]), rtol=RTOL, atol=tol.loss)
        torch.testing.assert_close(r["norms"][0], ref["norms"][0], rtol=RTOL, atol=tol.norm)


@pytest.mark.parametrize("c", ALL, ids=lambda c: c.name)
def test_parameters_after_training_match_the_single_device_model(c: Case) -> None:
    expected, got = serial(c)["params"], merged_params(c)
    atol = bounds(serial(c), steps=STEPS, lr=LR, n_terms=TOKENS).params
    tied = c.gpt.get("tied", True)
    assert got.keys() == expected.keys() | ({"head.weight"} if tied else set())
    for name, want in expected.items():
        torch.testing.assert_close(got[name], want, rtol=0, atol=atol, msg=name)
    if tied:  # the last stage's copy is kept equal to the embedding, not just close
        assert torch.equal(got["head.weight"], got["tok_emb.weight"])


@pytest.mark.parametrize("c", [c for c in ALL if c.dp * c.tp > 1], ids=lambda c: c.name)
def test_every_dp_replica_and_tp_rank_of_a_stage_ends_bit_identical(c: Case) -> None:
    by_stage: dict[int, dict] = {}
    for r in ranks_of(c):
        first = by_stage.setdefault(r["coords"][2], r["params"])
        assert all(torch.equal(r["params"][n], first[n]) for n in first), r["coords"]


@pytest.mark.parametrize("c", ALL, ids=lambda c: c.name)
def test_only_the_first_and_last_stage_form_the_tied_embedding_group(c: Case) -> None:
    for r in ranks_of(c):
        ends = r["coords"][2] in (0, c.pp - 1)
        assert r["tied_group"] == (2 if ends and c.gpt.get("tied", True) else 0), r["coords"]


def test_activations_in_flight_follow_the_schedule() -> None:
    for c in ALL:
        for r in ranks_of(c):
            pp_rank = r["coords"][2]
            if c.schedule == "gpipe":
                assert r["in_flight"] == c.m, c.name
            elif c.schedule == "1f1b":
                assert r["in_flight"] == min(c.pp - pp_rank, c.m), c.name


# -- checkpoints and timeline through trainer.train.train -------------------------------------

CKPT = [(world, case(name)) for world, name in CHECKPOINT_CASE.items()]
CKPT_IDS = [c.name for _, c in CKPT]


def ckpt_of(world: int) -> list[dict]:
    return [r["checkpoint"] for r in world_run(WORKER, world).ranks]


@pytest.mark.parametrize("world,c", CKPT, ids=CKPT_IDS)
def test_every_rank_writes_the_slices_of_its_stage_and_the_meta_records_the_layout(
        world: int, c: Case) -> None:
    step = Path(ckpt_of(world)[0]["run_dir"]) / "checkpoints" / "step-2"
    assert sorted(p.name for p in step.iterdir()) == [
        "COMMITTED", "index.json", "meta.json", *(f"rank-{r:05d}.safetensors"
                                                  for r in range(world)), "rng.safetensors"]
    layout = json.loads((step / "meta.json").read_text())["layout"]
    assert (layout["pp"], layout["virtual_stages"], layout["stage_layers"]) == (
        c.pp, c.v, list(c.config().stage_layers))


@pytest.mark.parametrize("world,c", CKPT, ids=CKPT_IDS)
def test_a_resumed_pipeline_run_is_bit_identical_to_an_uninterrupted_one(world: int,
                                                                         c: Case) -> None:
    for ck, whole in zip(ckpt_of(world), ranks_of(c), strict=True):
        assert ck["start"] == 2
        assert ck["first"] + ck["second"] == whole["losses"]  # exact, not just close
    saved = assemble(Path(ckpt_of(world)[0]["run_dir"]) / "checkpoints" / f"step-{STEPS}")
    for whole in ranks_of(c):  # the tied head's copy on the last stage is tok_emb's slice too
        for name, placement in whole["placements"].items():
            assert torch.equal(slice_of(saved[placement.name], placement),
                               whole["local"][name].view(-1)), (whole["coords"], name)


@pytest.mark.parametrize("world,c", CKPT, ids=CKPT_IDS)
def test_a_pipeline_checkpoint_resumes_without_a_pipeline(world: int, c: Case) -> None:
    for ck in ckpt_of(world):
        start, losses = ck["flat"]
        assert start == STEPS and len(losses) == 1 and math.isfinite(losses[0])


@pytest.mark.parametrize("world,c", CKPT, ids=CKPT_IDS)
def test_the_run_writes_the_last_steps_timeline_as_perfetto_json_and_a_gantt_png(
        world: int, c: Case) -> None:
    run_dir = Path(ckpt_of(world)[0]["run_dir"])
    trace = json.loads((run_dir / "timeline.json").read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {f"rank {r}" for r in range(c.pp)}
    compute = [e for e in trace["traceEvents"] if e.get("cat") in ("F", "B")]
    assert len(compute) == 2 * c.m * c.v * c.pp
    assert (run_dir / "timeline.png").read_bytes()[:4] == b"\x89PNG"


# -- without MPI ------------------------------------------------------------------------------

def test_layers_are_balanced_with_the_remainder_on_middle_stages_first() -> None:
    assert balanced_counts(7, 4) == (2, 2, 2, 1)
    assert balanced_counts(6, 4) == (1, 2, 2, 1)
    assert balanced_counts(9, 4) == (2, 3, 2, 2)
    assert balanced_counts(8, 8) == (1,) * 8
    assert describe((2, 0, 1)) == "0-1|-|2"


def test_a_layer_split_that_does_not_fit_is_refused_naming_the_option() -> None:
    with pytest.raises(ConfigError, match=r"\[n_layer=2, pp=2, virtual stages=2\]: 2 layer"):
        stage_counts(2, 2, 2)
    with pytest.raises(ConfigError, match=r"\[--pp-layers 3,2\]: it gives 2 count\(s\) but "
                                          r"pp\*v = 4\*1 = 4"):
        stage_counts(5, 4, 1, (3, 2))
    with pytest.raises(ConfigError, match="add up to 6 but the model has 5 layers"):
        stage_counts(5, 2, 1, (3, 3))
    with pytest.raises(ConfigError, match=r"stage\(s\) 1 would run no layer"):
        stage_counts(5, 3, 1, (3, 0, 2))
    assert stage_counts(5, 3, 1, (0, 5, 0)) == (0, 5, 0)


def test_an_interleaved_rank_holds_the_layers_of_stages_r_and_r_plus_p() -> None:
    layout = StageLayout(p=2, v=2, rank=1, counts=(2, 2, 2, 2))
    assert [layout.stage(c) for c in range(2)] == [1, 3]
    assert layout.owned_layers() == [2, 3, 6, 7]
    assert layout.is_last(1) and not layout.is_first(0) and layout.holds_last


def test_stage_models_keep_global_names_and_the_serial_initial_weights() -> None:
    cfg = GPTConfig(n_layer=4, n_head=2, d_model=16, seq_len=8)
    serial = dict(GPT(cfg, seed=3).named_parameters())
    first = build_stage_model(cfg, 3, StageLayout(2, 1, 0, (2, 2)))
    last = build_stage_model(cfg, 3, StageLayout(2, 1, 1, (2, 2)))
    assert [k for k, _ in first.layers()] == [0, 1] and [k for k, _ in last.layers()] == [2, 3]
    assert first.head is None and last.tok_emb is None
    assert last.head.weight is not last.blocks["2"].ln1.weight
    assert torch.equal(last.head.weight, serial["tok_emb.weight"])
    for name, p in [*first.named_parameters(), *last.named_parameters()]:
        assert torch.equal(p, serial["tok_emb.weight" if name == "head.weight" else name])


def test_gpt_stages_run_in_one_process_give_the_serial_loss_and_gradients() -> None:
    """Stage 0 then stage 1 per microbatch, backward in reverse, tied gradients added; fp64,
    so the loss agrees to the reduction bound over the 2 x 2 x 8 tokens and d_model, and each
    gradient element to that bound times its magnitude: the sum over the microbatches (and,
    for the tied weight, over its two uses) of the contributions' absolute values, measured."""
    with float64():
        _stages_match_serial()


def _stages_match_serial() -> None:
    cfg = GPTConfig(n_layer=3, n_head=2, d_model=16, seq_len=8)
    gen = torch.Generator().manual_seed(0)
    batch = [(torch.randint(0, 256, (2, 8), generator=gen),
              torch.randint(0, 256, (2, 8), generator=gen)) for _ in range(2)]
    serial = GPT(cfg, seed=1)
    magnitude: dict[str, torch.Tensor] = {}
    for x, y in batch:  # each microbatch's contribution alone, for the magnitudes
        serial.zero_grad()
        (serial.loss(x, y) / len(batch)).backward()
        for name, p in serial.named_parameters():
            magnitude[name] = magnitude.get(name, 0) + p.grad.abs()
    serial.zero_grad()
    loss = sum(serial.loss(x, y) / len(batch) for x, y in batch)
    loss.backward()
    stages = [GPTStage(build_stage_model(cfg, 1, StageLayout(2, 1, r, (1, 2))),
                       StageLayout(2, 1, r, (1, 2))) for r in range(2)]
    for s in stages:
        s.begin_step(batch)
    emb, head = stages[0].model.tok_emb.weight, stages[1].model.head.weight
    tied_magnitude, before = torch.zeros_like(emb), [torch.zeros_like(emb)] * 2
    total = 0.0
    for mb in range(2):
        total += stages[1].forward(mb, 0, stages[0].forward(mb, 0, None)).item()
        stages[0].backward(mb, 0, stages[1].backward(mb, 0, None))
        # The tied weight's uses apart: the embedding's and the head's part of this microbatch.
        for i, p in enumerate((emb, head)):
            tied_magnitude += (p.grad - before[i]).abs()
            before[i] = p.grad.clone()
    terms = 2 * 2 * 8 + 16
    assert total == pytest.approx(loss.item(), rel=reduction_rtol(terms))
    got = {**dict(stages[1].model.named_parameters()), **dict(stages[0].model.named_parameters())}
    tied = got["tok_emb.weight"].grad + got.pop("head.weight").grad
    assert_within_order(tied, serial.tok_emb.weight.grad, n_terms=terms,
                        magnitude=torch.maximum(tied_magnitude, magnitude["tok_emb.weight"]),
                        name="tok_emb.weight")
    for name, p in serial.named_parameters():
        if name != "tok_emb.weight":
            assert_within_order(got[name].grad, p.grad, n_terms=terms, magnitude=magnitude[name],
                                name=name)


def test_the_training_entry_takes_the_pipeline_options() -> None:
    cfg = parse_args(["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2",
                      "--microbatches", "4", "--n-layer", "5", "--pp-layers", "2,1,1,1"])
    par = cfg.parallel
    assert (par.pp, par.schedule, par.virtual_stages, cfg.stage_layers) == (
        2, "interleaved", 2, (2, 1, 1, 1))
    assert parse_args(["--pp", "4", "--n-layer", "7"]).stage_layers == (2, 2, 2, 1)
