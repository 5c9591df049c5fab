"""Tensor-parallel layers equal their serial counterparts, with real MPI ranks (tp = 2 and 4).

Every rank of ``mpiexec -n N python -m tests.support.tp_workers.worker`` runs each layer on its
shard
of the same full weights and inputs (`tests.support.tp_workers.cases.layer_tensors`); here the
pieces
are re-assembled (`trainer.parallel.tensor.unshard`) and compared with plain torch on the full
tensors: forward output, input gradient, weight and bias gradients. The tensors are fp64 and TP
changes only the order of the sums (row-parallel partial products, the all-reduced input
gradient), so both sides differ by at most 2(n-1)·u·Σ|terms| (tests/support/numerics.py): with n
<= 32
terms of magnitude <= ~16 that is ~1e-12, far inside torch.testing's fp64 defaults (1e-7).

Also here: how many collectives a TP GPT issues (2 all-reduces per layer forward, 2 backward),
dropout-safe recompute, the refusal of a model that does not split, and the pure helpers.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from tests.support.mpi_runs import world_run
from tests.support.tp_workers.cases import LINEAR_VARIANTS, WORKER, layer_tensors
from tests.support.tp_workers.layer_probes import COUNT_BATCH, COUNT_CFG
from trainer.model.config import GPTConfig
from trainer.parallel.tensor import (
    TP_RNG,
    RNGStatesTracker,
    ShardSpec,
    TensorParallelError,
    shard_tensor,
    unshard,
)
from trainer.parallel.tensor.parallelize import check_divisible

LAYERS = [*LINEAR_VARIANTS, "embedding", "cross_entropy"]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"tp{n}")
def ranks(request: pytest.FixtureRequest) -> list[dict]:
    return world_run(WORKER, request.param).ranks


@functools.cache
def serial(layer: str) -> dict[str, torch.Tensor]:
    """The same computation on one process, whole tensors, plain torch."""
    t = layer_tensors()
    if layer == "embedding":
        w = t["emb"].clone().requires_grad_(True)
        y = F.embedding(t["idx"], w)
        (y * t["gemb"]).sum().backward()
        return {"y": y.detach(), "dw": w.grad}
    if layer == "cross_entropy":
        logits = t["logits"].clone().requires_grad_(True)
        loss = F.cross_entropy(logits, t["target"], reduction="none")
        (loss * t["gloss"]).sum().backward()
        return {"loss": loss.detach(), "dlogits": logits.grad}
    x, w, b = (t[k].clone().requires_grad_(True) for k in ("x", "w", "b"))
    y = F.linear(x, w, b)
    (y * t["gy"]).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "dw": w.grad, "db": b.grad}


def assembled(ranks: list[dict], layer: str, key: str) -> list[torch.Tensor]:
    """The full tensor as each rank's piece says: every rank's own copy when it is replicated,
    else one re-assembly of all the shards."""
    pieces = [r["layers"][layer][key] for r in ranks]
    spec = pieces[0][1]
    if spec is None:
        return [tensor for tensor, _ in pieces]
    return [unshard([tensor for tensor, _ in pieces], spec)]


@pytest.mark.parametrize("layer", LAYERS)
def test_layer_output_and_gradients_equal_the_serial_layer(ranks: list[dict], layer: str) -> None:
    expected = serial(layer)
    assert ranks[0]["layers"][layer].keys() == expected.keys()
    for key, want in expected.items():
        for got in assembled(ranks, layer, key):
            torch.testing.assert_close(got, want, msg=lambda m, k=key: f"{layer}.{k}: {m}")


def test_shards_are_genuinely_split_not_replicated(ranks: list[dict]) -> None:
    n = len(ranks)
    column = ranks[0]["layers"]["column"]
    assert column["dw"][0].shape == (24 // n, 16)
    assert ranks[0]["layers"]["row"]["dw"][0].shape == (24, 16 // n)
    assert ranks[0]["layers"]["embedding"]["dw"][0].shape == (32 // n, 16)
    assert ranks[0]["layers"]["cross_entropy"]["dlogits"][0].shape == (16, 32 // n)


def test_a_gpt_costs_two_all_reduces_per_layer_each_way_and_three_small_ones_for_the_loss(
        ranks: list[dict]) -> None:
    """Forward: proj and mlp.proj of every layer + the embedding (B*T*D fp32 each) + the
    3 per-token reductions of the vocab-parallel loss; backward: qkv and mlp.fc input grads of
    every layer + the head's. No all-gather: the logits are never gathered."""
    L, act = COUNT_CFG.n_layer, COUNT_BATCH * COUNT_CFG.seq_len * COUNT_CFG.d_model * 4
    tokens = COUNT_BATCH * COUNT_CFG.seq_len * 4
    for rank in ranks:
        counts = rank["counts"]["counts"]
        assert set(counts) == {"forward/all_reduce", "backward/all_reduce"}
        assert counts["forward/all_reduce"] == (2 * L + 1 + 3, (2 * L + 1) * act + 3 * tokens)
        assert counts["backward/all_reduce"] == (2 * L + 1, (2 * L + 1) * act)


def test_recompute_restores_the_tp_random_stream_so_dropout_grads_match(
        ranks: list[dict]) -> None:
    for rank in ranks:
        plain, ours, torch_ckpt = (rank["recompute"][m] for m in ("plain", "ours", "torch"))
        assert torch.equal(ours["out"], plain["out"])
        assert torch.equal(ours["dh"], plain["dh"])
        assert ours["grads"].keys() == plain["grads"].keys() and plain["grads"]
        for name, grad in plain["grads"].items():
            assert torch.equal(ours["grads"][name], grad), name
        # torch's checkpoint restores the default generator only: its recomputed attention
        # dropout mask comes from the moved-on TP stream, so its gradients differ.
        assert not torch.equal(torch_ckpt["dh"], plain["dh"])


def test_a_model_that_does_not_split_is_refused_naming_every_field(ranks: list[dict]) -> None:
    tp = len(ranks)
    for rank in ranks:
        text = rank["refusal"]
        assert text.startswith("TensorParallelError: model does not split over the "
                               f"tensor-parallel group [--tp {tp}]: n_head = {tp + 1}, ")
        assert "vocab_size = 255" in text and f"not divisible by tp = {tp}" in text
        assert "Choose a tp that divides" in text


def test_divisibility_check_accepts_a_model_that_splits() -> None:
    check_divisible(GPTConfig(n_head=4, d_model=32), 4)
    with pytest.raises(TensorParallelError, match=r"\[--tp 3\]: n_head = 4, d_model = 32"):
        check_divisible(GPTConfig(n_head=4, d_model=32), 3)


@pytest.mark.parametrize("stride", [1, 3])
def test_shard_then_unshard_round_trips_and_stride_three_keeps_q_k_v_of_own_heads(
        stride: int) -> None:
    full = torch.arange(24.0).reshape(12, 2)
    spec = ShardSpec(0, stride)
    shards = [shard_tensor(full, r, 2, spec) for r in range(2)]
    assert torch.equal(unshard(shards, spec), full)
    if stride == 3:  # q rows 0-3, k rows 4-7, v rows 8-11; rank 0 gets the first half of each
        assert shards[0][:, 0].tolist() == [0, 2, 8, 10, 16, 18]


def test_forking_the_tracker_leaves_the_default_stream_where_it_was() -> None:
    tracker = RNGStatesTracker()
    tracker.seed(TP_RNG, 5)
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    with tracker.fork():
        first = torch.rand(4)
    assert torch.equal(torch.rand(4), expected)        # default stream untouched
    with tracker.fork():
        second = torch.rand(4)
    assert not torch.equal(first, second)               # the tracked stream moves on
    tracker.seed(TP_RNG, 5)
    with tracker.fork():
        assert torch.equal(torch.rand(4), first)        # reseeding replays it


def test_forking_an_unseeded_stream_is_refused_with_the_remedy() -> None:
    with pytest.raises(Exception, match=r"unknown random stream \[tensor-parallel\].*seed"):
        with RNGStatesTracker().fork():
            pass
