"""The layout planner (`python -m trainer.plan`): its memory per rank equals what the trainer
holds when it runs the layout, its model shapes are the published ones, and bad input gets one
clear error."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from trainer.config.options import make_config, resolve_dp
from trainer.errors import ConfigError
from trainer.plan.cluster import make_cluster
from trainer.plan.estimate import comm, memory
from trainer.plan.shapes import stage_params

ROOT = Path(__file__).resolve().parents[2]
CPU = make_cluster(hosts=1, gpus_per_host=2, memory_gib=16, tflops=0.1, intra_gbps=5,
                   inter_gbps=1)


def test_llama_3_8b_and_70b_have_their_published_parameter_counts() -> None:
    from trainer.model.config import PRESETS

    assert sum(s.dense for s in stage_params(PRESETS["llama3-8b"], tp=1, pp=1)) == 8_030_261_248
    seventy = make_config({"model": "llama3-8b", "n_layer": 80, "d_model": 8192, "n_head": 64,
                           "n_kv_head": 8, "ffn_hidden": 28672}).gpt
    assert sum(s.dense for s in stage_params(seventy, tp=1, pp=1)) == 70_553_706_496


def test_the_8b_memory_at_tp_2_zero_1_equals_a_calculation_by_hand() -> None:
    """Llama 3 8B on 8 H100s at dp4 x tp2, ZeRO-1, bf16: each rank holds half of every matrix
    and of the (untied) embedding and head, and the whole norms; bf16 parameters (2 bytes),
    fp32 gradients (4) and 12/dp bytes of fp32 main weights and Adam moments per parameter."""
    d, kv, ffn, vocab, layers = 4096, 1024, 14336, 128256, 32
    block = (d * d + 2 * d * kv + d * d + 3 * d * ffn) // 2 + 2 * d
    n = layers * block + 2 * vocab * d // 2 + d
    cfg = resolve_dp(make_config({"model": "llama3-8b", "tp": 2, "zero": 1, "global_batch": 8,
                                  "seq_len": 1024, "precision": "bf16"}), 8)
    mem = memory(cfg, make_cluster(hosts=1, gpus_per_host=8, gpu="h100"))
    assert (mem.params, mem.grads, mem.optimizer) == (2 * n, 4 * n, 12 * n // 4)


def test_a_layout_the_trainer_refuses_is_refused_with_the_trainers_reason() -> None:
    from trainer.plan.estimate import plan

    done, refused = plan({"model": "tiny", "global_batch": 4, "seq_len": 64,
                          "precision": "fp32"}, make_cluster(hosts=1, gpus_per_host=8,
                                                             gpu="h100"))
    assert done and all(e.config.parallel.dp * e.config.parallel.tp * e.config.parallel.pp
                        * e.config.parallel.cp == 8 for e in done)
    assert refused  # tp 8 does not divide tiny's 4 heads, nor dp 8 a batch of 4
    assert all(isinstance(r, ConfigError) and str(r) for r in refused)


def test_an_unknown_gpu_is_one_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"unknown GPU \[--gpu b200x\]: known GPUs: h100"):
        make_cluster(hosts=1, gpus_per_host=8, gpu="b200x")


def _plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainer.plan", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False)


def test_the_command_refuses_a_config_it_cannot_read_and_a_layout_that_does_not_divide(
        tmp_path: Path) -> None:
    broken = tmp_path / "config.json"
    broken.write_text("{not json")
    done = _plan("--gpu", "h100", "--hf-config", str(broken))
    assert done.returncode == 2
    assert done.stderr.count("cannot read the model's config") == 1
    assert f"[--hf-config {broken}]" in done.stderr
    done = _plan("--gpu", "h100", "--hosts", "1", "--gpus-per-host", "3", "--model", "tiny",
                 "--global-batch", "4", "--seq-len", "64")
    assert done.returncode == 1
    assert "no layout of the trainer's fits these GPUs" in done.stderr


def test_the_command_ranks_layouts_and_prints_json_for_scripts() -> None:
    done = _plan("--gpu", "h100", "--hosts", "1", "--gpus-per-host", "2", "--model", "tiny",
                 "--global-batch", "4", "--seq-len", "64", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    layouts = out["layouts"]
    assert {(r["dp"], r["tp"], r["pp"], r["cp"]) for r in layouts} == {
        (2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2)}
    steps = [r["step_s"] for r in layouts if r["fits"]]
    assert steps == sorted(steps)
    assert "ring algorithms" in out["assumptions"]


# The trainer's own accounting (bench.memory: held tensors and the saved-tensor peak of a real
# step) for layouts of 1 and 2 ranks, against the planner's prediction for the same run, on the
# tiny and the small model (4 blocks of width 256: ZeRO-2 then stages many buckets, and a
# block's weights weigh next to its activations). One step each, a short sequence.
MEASURED = {"serial": (1, {}), "dp2": (2, {"dp": 2}), "dp2+zero1": (2, {"dp": 2, "zero": 1}),
            "tp2": (2, {"dp": 1, "tp": 2}), "pp2": (2, {"dp": 1, "pp": 2, "microbatches": 4}),
            "tp2+sp": (2, {"dp": 1, "tp": 2, "sequence_parallel": True}),
            "tp2+recompute full": (2, {"dp": 1, "tp": 2, "recompute": "full"}),
            "dp2+recompute selective": (2, {"dp": 2, "recompute": "selective"}),
            "dp2+zero2": (2, {"dp": 2, "zero": 2}), "dp2+zero3": (2, {"dp": 2, "zero": 3})}
MODELS = {"tiny": 64, "small": 128}
"""Model -> sequence length of the measured runs."""
BUCKET = 250_000
"""DP bucket elements, in the measured runs and in the plans alike (small's gradients span
13 buckets of it)."""


@pytest.fixture(scope="module", params=sorted(MODELS))
def measured(request: pytest.FixtureRequest) -> tuple[str, dict[str, dict]]:
    from bench import memory as bench_memory

    model = request.param
    rows = bench_memory.run(model=model, seq_len=MODELS[model], global_batch=8, steps=1,
                            bucket_size=BUCKET)
    return model, {r["layout"]: r for r in rows}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", sorted(MEASURED))
def test_the_planned_memory_per_rank_equals_what_the_trainer_holds(
        layout: str, measured: tuple[str, dict[str, dict]]) -> None:
    model, rows = measured
    world, over = MEASURED[layout]
    row = rows[layout]
    # Planned for the overlap the run chose on this host (`reduction_schedule`).
    cfg = resolve_dp(make_config({"model": model, "global_batch": 8, "precision": "fp32",
                                  "bucket_size": BUCKET, **over, "overlap": row["overlap"]},
                                 {"seq_len": MODELS[model]}), world)
    mem = memory(cfg, CPU)
    mib = 2**20
    # The planner's rank at its peak: ZeRO-2's staged gradient buckets, ZeRO-3's gathered
    # units and their gradients during the step (bench.memory's "peak" columns) included.
    params, grads = row["params_peak_mib"], row["grads_peak_mib"]
    total = params + grads + row["optim_mib"] + row["act_mib"]
    components = [(mem.params, params), (mem.optimizer, row["optim_mib"]),
                  (mem.activations, row["act_mib"]), (mem.total, total)]
    if cfg.optimizer.zero == 2:
        # A bucket's staging is freed when its reduction is seen finished, at the next hook:
        # how many are held at once depends on how fast the reductions run, from one (each
        # done before the next fills, as with overlap off) to the planner's worst case, the
        # one being filled and IN_FLIGHT reducing. The total holds within 5% either way.
        least = memory(replace(cfg, parallel=replace(cfg.parallel, overlap=False)), CPU).grads
        assert least / mib * 0.95 <= grads <= mem.grads / mib * 1.05, (model, layout, grads)
    else:
        components.append((mem.grads, grads))
    for planned, held in components:
        assert planned / mib == pytest.approx(held, rel=0.05), (model, layout, planned / mib,
                                                                held)


def test_zero_2_stages_the_bucket_being_filled_besides_those_in_flight() -> None:
    """The staging replayed for the planner (`peak_staged_bytes`) is the trainer's: at most
    `IN_FLIGHT` launched buckets (their wires) plus the one being filled, across the end of a
    round when a step runs several backwards; one bucket when each is waited for at once."""
    from trainer.parallel.zero.grad_shards import IN_FLIGHT, peak_staged_bytes

    sizes = [10, 30, 20, 5]
    assert IN_FLIGHT == 2
    assert peak_staged_bytes(sizes, in_flight=2, rounds=1, main_bytes=4, wire_bytes=4) == \
        4 * (10 + 30 + 20)
    assert peak_staged_bytes(sizes, in_flight=0, rounds=1, main_bytes=4, wire_bytes=4) == 4 * 30
    # two backwards: the last two buckets still reduce when the first one is filled again
    assert peak_staged_bytes([30, 5, 20, 10], in_flight=2, rounds=2, main_bytes=4,
                             wire_bytes=4) == 4 * (20 + 10 + 30)
    # a bf16 wire: the launch holds the fp32 staging and its bf16 copy at once
    assert peak_staged_bytes([30], in_flight=2, rounds=1, main_bytes=4, wire_bytes=2) == 6 * 30


def test_the_planned_traffic_is_the_gradient_reduction_of_the_rank() -> None:
    cfg = resolve_dp(make_config({"model": "tiny", "global_batch": 8, "precision": "fp32",
                                  "dp": 2}, {"seq_len": 64}), 2)
    n = sum(s.dense for s in stage_params(cfg.gpt, tp=1, pp=1))
    assert comm(cfg, CPU).dp == pytest.approx(2 * 0.5 * 4 * n)


# `python -m trainer.train` prints the plan of its own run and checks it after the first step.
TRAIN = ["-m", "trainer.train", "--model", "tiny", "--seq-len", "64", "--global-batch", "8",
         "--steps", "1", "--eval-every", "0", "--precision", "fp32", "--data-cap-mb", "1"]
HALVED = """
import sys
from dataclasses import replace
import trainer.plan.estimate as estimate
real = estimate.memory
estimate.memory = lambda cfg, cluster: replace(real(cfg, cluster), activations=0, params=0)
from trainer.train import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_training_run_prints_the_plan_of_its_layout_and_holds_what_it_said(
        tmp_path: Path) -> None:
    from tests.support.mpi_runs import run_ranks

    done = run_ranks(2, [*TRAIN, "--tp", "2", "--run-dir", str(tmp_path / "run")])
    assert done.returncode == 0, done.stdout[-3000:]
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("dtrain: plan (")]
    assert len(lines) == 1, done.stdout  # rank 0 only
    assert lines[0].startswith("dtrain: plan (dp1 tp2 pp1, largest rank): parameters ")
    assert "warning: memory per rank" not in done.stdout


def test_a_run_whose_memory_differs_from_the_plan_is_warned_about_once(tmp_path: Path) -> None:
    """The plan made wrong on purpose (no activations, no parameters): the measured bytes are
    then far above it, and rank 0 says so once, naming both numbers."""
    from tests.support import PYTHON, REPO, dtrain_env

    done = subprocess.run([PYTHON, "-c", HALVED, *TRAIN[2:], "--steps", "2",
                           "--run-dir", str(tmp_path / "run")], cwd=REPO, env=dtrain_env(),
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    warned = [ln for ln in (done.stdout + done.stderr).splitlines()
              if "warning: memory per rank" in ln]
    assert len(warned) == 1, done.stdout + done.stderr
    assert re.search(r"measured [\d.]+ MiB, the plan says [\d.]+ MiB \(\+\d+%, more than 10% "
                     r"apart\)", warned[0]), warned[0]


def test_layouts_the_planner_does_not_model_yet_are_said_so_without_a_check() -> None:
    from trainer.training.plan_check import line, not_modelled, plan_of, run_cluster, warning

    cluster = run_cluster(2, 2, torch.device("cpu"))
    free = resolve_dp(make_config({"model": "tiny", "dp": 2, "ep": 2, "moe_experts": 4,
                                   "global_batch": 8, "precision": "fp32"}), 2)
    assert not_modelled(free).startswith("a mixture of experts without --moe-capacity-factor")
    assert line(plan_of(free, cluster)).endswith("depend on the data); no memory check")
    for modelled in ({"dp": 2, "zero": 3}, {"dp": 1, "cp": 2}):
        cfg = resolve_dp(make_config({"model": "tiny", "global_batch": 8, "precision": "fp32",
                                      **modelled}), 2)
        assert not_modelled(cfg) == ""
    assert warning(100 * 2**20, 109 * 2**20) == ""
    assert "-20%" in warning(100 * 2**20, 80 * 2**20)


# The planner against the trainer on 2 ranks, 4 for the dp4 rows (bench.plan_check: the
# trainer's own step, its communicators counting what they send as the planner prices it, the
# same memory accounting: ZeRO-2/3's peaks during the step included), on the tiny and the small
# model, one timed step after the first.
@pytest.fixture(scope="module", params=sorted(MODELS))
def against_the_trainer(request: pytest.FixtureRequest) -> tuple[str, dict[str, dict]]:
    from bench import plan_check

    model = request.param
    rows = plan_check.run(model=model, seq_len=MODELS[model], global_batch=8, steps=1)
    return model, {r["layout"]: r for r in rows}


DENSE = ("dp2", "tp2", "pp2 1f1b", "dp2+zero1", "tp2+sp", "tp2+recompute full",
         "dp2+recompute selective", "dp2+zero2", "dp2+zero3", "dp4+zero3", "dp4+zero3 shard2",
         "cp2", "cp2 ring+recompute selective")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", DENSE)
def test_the_planned_bytes_per_step_equal_what_each_group_sends(
        layout: str, against_the_trainer: tuple[str, dict[str, dict]]) -> None:
    model, rows = against_the_trainer
    row = rows[layout]
    assert row[f"{layout[:2]}_mb"] > 0  # the layout's own group sent something
    for kind in ("dp", "tp", "pp", "ep", "cp"):
        assert row[f"{kind}_plan_mb"] == pytest.approx(row[f"{kind}_mb"], rel=0.05, abs=1e-6), \
            (model, layout, kind, row)
    assert row["mem_plan_mib"] == pytest.approx(row["mem_mib"], rel=0.05), (model, row)


@pytest.mark.timeout(900)
def test_the_planned_gradient_reduction_of_ep2_keeps_the_experts_out_of_the_dp_group(
        against_the_trainer: tuple[str, dict[str, dict]]) -> None:
    """Under ep2 over 2 ranks the experts are not replicated (edp 1): only the dense
    parameters' gradients are all-reduced, as the planner counts them."""
    model, rows = against_the_trainer
    row = rows["ep2 moe"]
    assert row["dp_mb"] > 0 and row["ep_mb"] > 0
    assert row["dp_plan_mb"] == pytest.approx(row["dp_mb"], rel=0.05), (model, row)


@pytest.mark.timeout(900)
def test_the_planned_memory_of_ep2_with_capacity_matches_the_run(
        against_the_trainer: tuple[str, dict[str, dict]]) -> None:
    """The experts' gradients live in a buffer of their own (their DP group is not the dense
    parameters'), counted with the rest; the experts' activations grow with the rows the run's
    routing gives the rank's experts (`trainer.plan.routing.measured_rows`). The first step is
    planned with the router it runs; a later step's router has trained (the timed step: within
    5% too)."""
    model, rows = against_the_trainer
    row = rows["ep2 moe"]
    assert row["mem_first_plan_mib"] == pytest.approx(row["mem_first_mib"], rel=0.05), \
        (model, row)
    assert row["mem_plan_mib"] == pytest.approx(row["mem_mib"], rel=0.05), (model, row)


@pytest.mark.timeout(900)
def test_the_planned_all_to_all_bytes_of_ep2_with_capacity_match_the_first_step(
        against_the_trainer: tuple[str, dict[str, dict]]) -> None:
    """With a capacity, which rows go to the other rank depends on the data (text repeats
    characters, which route alike and overflow their expert) and on the router: the planner
    routes the run's own batches of the step through the run's initial model
    (`trainer.plan.routing`), which is the first step's. (After one step at lr 1e-4 the small
    model's router sends 8% fewer rows: bench.plan_check's timed ``ep`` columns.)"""
    model, rows = against_the_trainer
    row = rows["ep2 moe"]
    assert row["ep_first_plan_mb"] == pytest.approx(row["ep_first_mb"], rel=0.05), (model, row)


def test_the_all_to_all_falls_back_to_balanced_routing_where_the_run_is_not_routed(
        tmp_path: Path) -> None:
    """Without --plan-routing (the default: a run's start-up builds no second model), without
    the run's data here, or under cp (a cp rank routes its share of each sequence), the planner
    counts balanced routing: topk x min(1, capacity) x (ep - 1)/ep rows per token and MoE
    layer, one way."""
    from trainer.plan.routing import balanced_share, measured_rows, sent_share

    moe = {"model": "tiny", "global_batch": 8, "precision": "fp32", "moe_experts": 4,
           "moe_topk": 2, "moe_capacity_factor": 0.75, "eval_every": 0}
    off = resolve_dp(make_config({**moe, "dp": 2, "ep": 2}, {"seq_len": 64}), 2)
    assert not off.logging.plan_routing
    assert balanced_share(off) == 2 * 0.75 * 0.5
    assert sent_share(off) == balanced_share(off) and measured_rows(off) is None
    routed = resolve_dp(make_config({**moe, "dp": 2, "ep": 2, "plan_routing": True,
                                     "moe_capacity_factor": 1.0, "data_cap_mb": 1.0},
                                    {"seq_len": 64}), 2)
    assert sent_share(routed) < balanced_share(routed)  # text overflows its experts
    assert measured_rows(routed) is not None
    away = resolve_dp(make_config({**moe, "dp": 2, "ep": 2, "plan_routing": True,
                                   "data": str(tmp_path / "absent.txt")}, {"seq_len": 64}), 2)
    assert sent_share(away) == balanced_share(away)
    cp = resolve_dp(make_config({**moe, "dp": 2, "ep": 2, "cp": 2, "plan_routing": True},
                                {"seq_len": 64}), 4)
    assert sent_share(cp) == balanced_share(cp)


def test_the_counted_operations_are_those_the_model_runs_on_real_tensors() -> None:
    """The planner counts a step's operations on fake tensors; the same model's forward and
    backward on real tensors issue as many (tiny: 266), and full recomputation adds each
    block's forward again."""
    from trainer.model.family import build_model
    from trainer.plan.operations import _Counter, operations
    from trainer.plan.shapes import RankModel

    cfg = make_config({"model": "tiny", "global_batch": 8, "precision": "fp32"},
                      {"seq_len": 64})
    counted = operations(cfg.gpt, RankModel(1, False, "none", 8))
    model = build_model(cfg.gpt, seed=0)
    idx = torch.zeros(8, 64, dtype=torch.long)
    real = _Counter()
    with real:
        model.loss(idx, idx).backward()
    assert 2 * counted.per_block.ops + counted.rest.ops == real.ops
    assert 2 * counted.per_block.flops + counted.rest.flops == real.flops
    full = operations(cfg.gpt, RankModel(1, False, "full", 8))
    assert full.per_block.ops > counted.per_block.ops
    assert full.per_block.flops == pytest.approx(4 / 3 * counted.per_block.flops, rel=0.05)
    assert full.rest == counted.rest


def test_a_gpus_host_time_overlaps_its_compute_and_a_cpus_adds_to_it() -> None:
    """The same layout on a device whose host issues operations ahead (a GPU: the step's
    compute is the longer of the two) and on one that is its own host (a CPU: the sum)."""
    from dataclasses import replace

    from trainer.plan.estimate import comm, step_time

    cfg = resolve_dp(make_config({"model": "tiny", "global_batch": 8, "precision": "fp32",
                                  "dp": 1, "tp": 2}, {"seq_len": 64}), 2)
    gpu = make_cluster(hosts=1, gpus_per_host=2, memory_gib=16, tflops=1e-3, intra_gbps=1e6,
                       inter_gbps=1e6, memory_gbps=1e6, op_us=0, intra_latency_us=0)
    traffic = comm(cfg, gpu)
    device, _ = step_time(cfg, gpu, traffic, 1.0)
    busy = replace(gpu, gpu=replace(gpu.gpu, op_s=device / 1e4))  # hosts 1e4 ops ~ device
    from trainer.plan.operations import rank_step

    host = rank_step(cfg, bf16=False).ops * busy.gpu.op_s
    assert step_time(cfg, busy, traffic, 1.0)[0] == pytest.approx(max(device, host), rel=1e-3)
    cpu = replace(busy, gpu=replace(busy.gpu, host_overlaps=False))
    assert step_time(cfg, cpu, traffic, 1.0)[0] == pytest.approx(device + host, rel=1e-3)
    slow = replace(gpu, intra_latency_s=1e-3)  # tp's all-reduces: 2 message steps each
    steps = rank_step(cfg, bf16=False).tp_steps
    assert steps > 0
    assert step_time(cfg, slow, traffic, 1.0)[0] == pytest.approx(device + steps * 1e-3,
                                                                  rel=1e-3)


def test_the_gpus_by_name_carry_their_memory_bandwidth_op_time_and_latencies() -> None:
    h100 = make_cluster(hosts=2, gpus_per_host=8, gpu="h100")
    assert (h100.gpu.memory_bw, h100.gpu.op_s, h100.gpu.host_overlaps) == (3.35e12, 10e-6, True)
    assert (h100.latency(8), h100.latency(16)) == (3.4e-6, 14e-6)
    custom = make_cluster(hosts=1, gpus_per_host=2, memory_gib=16, tflops=1, intra_gbps=5,
                          inter_gbps=1)
    assert (custom.gpu.memory_bw, custom.gpu.op_s, custom.intra_latency_s) == (0.0, 0.0, 0.0)
