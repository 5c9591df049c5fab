"""The MoE layer on one rank: against the plain-loop reference, capacity, imbalance, errors.

Everything runs in fp64 (tests/support/numerics.py), so the vectorised layer and the token-by-token
reference differ only by summation order: every output and gradient element to `reduction_rtol`
of all the terms on its chain of sums (`chain_terms`: the router's, an expert's two matmuls, the
combine, backward through them and a weight gradient's sum over every token) times its magnitude
measured on the test's weights and tokens (`tests.support.moe_reference.magnitudes`). The weights
are
drawn with standard deviation 0.5 and a weight's gradient sums over the tokens routed to it, so
neither is O(1): a bound assuming so held for one BLAS kernel and failed for another.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.moe_reference import chain_terms, magnitudes, reference_moe
from tests.support.numerics import assert_within_order, float64
from trainer.config.options import make_config, resolve_dp
from trainer.errors import ConfigError
from trainer.model.config import GPTConfig, MoEConfig
from trainer.model.gpt import GPT
from trainer.parallel.expert.dispatch import combine, dispatch
from trainer.parallel.expert.layer import MoE
from trainer.parallel.expert.router import Routing, capacity_mask, rank_resolution, route

D = 16


def make_layer(**moe: object) -> MoE:
    fields = {"experts": 4, "topk": 2, "z_loss_coeff": 1e-3, **moe}
    cfg = GPTConfig(n_layer=1, n_head=2, d_model=D, seq_len=8, moe=MoEConfig(**fields))
    torch.manual_seed(0)
    layer = MoE(cfg, GPT.make_mlp)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
    return layer


def compare_with_reference(layer: MoE, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Outputs, auxiliary losses and every gradient equal the reference's (an expert the
    reference never called has no gradient there, zeros in the layer); returns the layer's."""
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    out = layer(xs[0])
    aux = layer.route(xs[0].detach().reshape(-1, D)).aux_loss
    (out * upstream).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    ref_out, ref_aux = reference_moe(layer, xs[1])
    ((ref_out * upstream).sum() + ref_aux).backward()
    mag = magnitudes(layer, x, upstream)
    terms = chain_terms(layer, x.numel() // D)
    got = {"out": out, "aux": aux, "x": xs[0].grad, **grads}
    want = {"out": ref_out, "aux": ref_aux, "x": xs[1].grad, **{
        name: p.grad if p.grad is not None else torch.zeros_like(p)
        for name, p in layer.named_parameters()}}
    for name, value in got.items():
        assert_within_order(value.detach(), want[name].detach(), n_terms=terms,
                            magnitude=mag[name], name=name)
    return grads


@pytest.mark.parametrize("moe", [
    {}, {"router": "sigmoid", "topk": 1}, {"capacity_factor": 0.5},
    {"capacity_factor": 1.0, "topk": 3, "router": "sigmoid"}],
    ids=["dropless", "sigmoid-top1", "capacity-0.5", "capacity-1-sigmoid-top3"])
def test_the_layer_equals_the_plain_loop_reference(moe: dict) -> None:
    with float64():
        layer = make_layer(**moe)
        x = torch.randn(3, 8, D, generator=torch.Generator().manual_seed(2))
        compare_with_reference(layer, x)


def test_ties_of_saturated_sigmoid_scores_go_to_the_lower_expert_index() -> None:
    """Logits in the hundreds make sigmoid exactly 1.0 for about half of the 64 experts of
    every token; torch.topk picked other experts among those ties on CPU."""
    x = torch.randn(64, D, generator=torch.Generator().manual_seed(3)) * 100
    weight = torch.randn(64, D, generator=torch.Generator().manual_seed(4))
    scores = (x @ weight.t()).sigmoid()
    assert ((scores == 1).sum(-1) > 8).all()  # every token has ties above its top k
    routing = route(x, weight, topk=8, score="sigmoid")
    want = [sorted(range(64), key=lambda e: (-float(scores[t, e]), e))[:8] for t in range(64)]
    assert routing.experts.tolist() == want
    assert torch.equal(routing.weights, scores.gather(-1, routing.experts))


def test_the_layer_equals_the_reference_when_its_sigmoid_scores_saturate() -> None:
    with float64():
        layer = make_layer(router="sigmoid", experts=8, topk=3, capacity_factor=1.0)
        with torch.no_grad():
            layer.router.weight.mul_(1000)  # logits in the thousands: fp64 sigmoid is 1.0
        x = torch.randn(3, 8, D, generator=torch.Generator().manual_seed(2))
        assert (layer.route(x.reshape(-1, D)).weights == 1).sum() > 24  # ties in the top 3
        compare_with_reference(layer, x)


def test_a_capacity_factor_below_one_really_drops_tokens() -> None:
    with float64():
        layer = make_layer(capacity_factor=0.5)
        routing = layer.route(torch.randn(24, D, generator=torch.Generator().manual_seed(2)))
    # 24 tokens x 2 choices, 4 experts: each keeps ceil(48 * 0.5 / 4) = 6 of its assignments
    assert routing.dropped == sum(max(0, n - 6) for n in routing.routed.tolist()) > 0


def test_capacity_keeps_the_highest_scores_and_on_ties_the_earlier_token() -> None:
    experts = torch.tensor([[0], [0], [0], [1], [0]])
    weights = torch.tensor([[0.2], [0.9], [0.2], [0.1], [0.5]])
    kept = capacity_mask(experts, weights, n_experts=2, cap=2)
    assert kept.flatten().tolist() == [False, True, False, True, True]
    kept = capacity_mask(experts, torch.full((5, 1), 0.3), n_experts=2, cap=2)
    assert kept.flatten().tolist() == [True, True, False, True, False]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_capacity_ranks_scores_a_few_ulps_apart_as_ties_whatever_their_rounding(
        dtype: torch.dtype) -> None:
    # Identical tokens in identical contexts score equal in exact arithmetic; another BLAS
    # kernel or batch shape rounds them apart by a few ulps, in either order.
    score = torch.tensor(0.3, dtype=dtype)
    ulp = torch.finfo(dtype).eps * 0.3
    experts = torch.zeros(3, 1, dtype=torch.long)
    for later_is_higher in (True, False):
        nudge = 4 * ulp if later_is_higher else -4 * ulp
        weights = torch.stack([score, score, score + nudge]).view(3, 1)
        kept = capacity_mask(experts, weights, n_experts=1, cap=2)
        assert kept.flatten().tolist() == [True, True, False]
    assert rank_resolution(torch.float64) == 2.0 ** -26
    assert rank_resolution(torch.float32) == 2.0 ** -12


def test_a_router_biased_to_one_expert_sends_it_every_token_and_still_trains() -> None:
    with float64():
        layer = make_layer(topk=1)
        with torch.no_grad():
            layer.router.weight.zero_()
            layer.router.weight[2, 0] = 50.0  # expert 2 wins for every token with x_0 > 0
        x = torch.randn(2, 8, D, generator=torch.Generator().manual_seed(4))
        x[..., 0] = x[..., 0].abs() + 1
        routing = layer.route(x.reshape(-1, D))
        assert routing.routed.tolist() == [0, 0, 16, 0]
        grads = compare_with_reference(layer, x)
    # Experts without tokens still get a (zero) gradient, so DP's buckets complete.
    idle = [g for name, g in grads.items() if name.startswith("experts.0.")]
    assert idle and not any(g.any() for g in idle)


def test_combine_of_dispatch_is_the_identity_on_weights_of_one() -> None:
    x = torch.randn(10, D, generator=torch.Generator().manual_seed(5))
    experts = torch.randint(0, 4, (10, 1), generator=torch.Generator().manual_seed(6))
    routing = Routing(experts, torch.ones(10, 1), torch.ones(10, 1, dtype=torch.bool),
                      torch.zeros(()), torch.bincount(experts.flatten(), minlength=4))
    rows, plan = dispatch(x, routing, 4)
    assert plan.local_counts == routing.routed.tolist()
    assert torch.equal(combine(rows, plan, 10), x)


def test_a_uniform_router_has_a_load_balancing_loss_equal_to_its_coefficient() -> None:
    x = torch.randn(12, D, generator=torch.Generator().manual_seed(7))
    routing = route(x, torch.zeros(4, D), topk=2, aux_coeff=0.01)
    torch.testing.assert_close(routing.aux_loss, torch.tensor(0.01))


@pytest.mark.parametrize(("gpt", "train", "world", "message"), [
    ({"moe_experts": 4, "moe_topk": 5}, {}, 1,
     "[--moe-topk 5]: a token cannot go to more than the 4 experts"),
    ({"moe_experts": 4, "moe_router": "relu"}, {}, 1,
     "[--moe-router relu]: must be one of softmax, sigmoid"),
    ({"moe_experts": 6}, {"ep": 4}, 4, "6 experts is not a multiple of ep = 4"),
    ({"moe_experts": 4}, {"ep": 4}, 2, "ep = 4 does not divide them"),
    ({}, {"ep": 2}, 2, "the model has no MoE layers"),
], ids=["k-above-E", "unknown-router", "E-not-divisible", "ep-not-dividing-dp", "ep-no-experts"])
def test_a_bad_moe_option_is_refused_before_any_work(gpt: dict, train: dict, world: int,
                                                     message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_dp(make_config({"model": "tiny", "global_batch": 8, **train}, gpt), world)
    assert message in str(caught.value)
