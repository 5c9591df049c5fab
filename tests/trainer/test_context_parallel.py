"""The pure parts of context parallelism, in one process: the zig-zag split and its inverse,
global positions (rotary angles at them), the causal block plan and its balance, the errors
bad input gets, and attention on a cp group of one (an in-memory group: no peer to talk to)
equal to torch's causal attention. The multi-rank equality is
tests/trainer/test_context_parallel_attention.py."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch

from tests.support.cp_workers.cases import HEADS, SCALE, T, attention_tensors, serial
from tests.support.numerics import attention_atol
from trainer.model.config import GPTConfig
from trainer.model.layers import apply_rope, rope_tables
from trainer.model.llama import apply_rope_half, llama_rope_tables
from trainer.parallel.context import (
    EXCHANGES,
    ContextParallelAttention,
    ContextParallelError,
    SequenceLayout,
    Visibility,
    attention_flops,
    block_flops,
    block_plan,
    split_batch,
)
from trainer.parallel.context.blocks import block_backward, block_forward, fused_backward
from trainer.parallel.context.plan import visibility

MESSAGE = re.compile(r"^.+ \[.+\]: .+\. .+$", re.DOTALL)
"""``<what failed> [<where>]: <why>. <how to fix>``"""


class SoloGroup:
    """A cp group of one rank, in memory: gathering or reduce-scattering over one member copies."""

    rank, size, name, backend = 0, 1, "cp", "memory"

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        out.copy_(inp)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        out.copy_(inp)


def test_rank_r_holds_chunks_r_and_2cp_minus_1_minus_r_in_that_order():
    layout = SequenceLayout(8, 2)
    tokens = torch.arange(8)[None]
    assert layout.split_tensor(tokens, 0).tolist() == [[0, 1, 6, 7]]
    assert layout.split_tensor(tokens, 1).tolist() == [[2, 3, 4, 5]]
    assert [SequenceLayout(16, 4).chunks(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5),
                                                                   (3, 4)]


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("dim", [1, 2])
def test_joining_every_ranks_split_gives_back_the_sequence(cp: int, dim: int):
    layout = SequenceLayout(16, cp)
    x = torch.randn(2, 16, 16, 3)
    parts = [layout.split_tensor(x, r, dim) for r in range(cp)]
    assert all(p.shape[dim] == layout.local_len for p in parts)
    assert torch.equal(layout.join(parts, dim), x)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_positions_are_the_global_indices_of_the_ranks_tokens(cp: int):
    layout = SequenceLayout(24, cp)
    for r in range(cp):
        assert torch.equal(layout.positions(r), layout.split_tensor(torch.arange(24)[None], r)[0])


def test_a_split_batch_keeps_each_tokens_own_next_token_target():
    rows = torch.randint(0, 50, (3, 17))
    tokens, targets = rows[:, :-1], rows[:, 1:]
    layout = SequenceLayout(16, 2)
    for r in range(2):
        local = split_batch(tokens, targets, layout, r)
        assert torch.equal(local.tokens, tokens[:, local.positions])
        assert torch.equal(local.targets, rows[:, local.positions + 1])


def test_rotary_at_a_ranks_global_positions_equals_the_rotated_whole_sequence_split():
    layout = SequenceLayout(16, 4)
    x_BHTK = torch.randn(2, 3, 16, 8, dtype=torch.float64)
    cos, sin = rope_tables(16, 8, 10000.0)
    llama_cos, llama_sin = llama_rope_tables(GPTConfig(seq_len=16, n_head=2, d_model=16))
    for r in range(4):
        at = layout.positions(r)
        local = layout.split_tensor(x_BHTK, r, 2)
        assert torch.equal(apply_rope(local, cos[at], sin[at]),
                           layout.split_tensor(apply_rope(x_BHTK, cos, sin), r, 2))
        x_BTHK = x_BHTK.transpose(1, 2)
        assert torch.equal(
            apply_rope_half(layout.split_tensor(x_BTHK, r, 1), llama_cos[at], llama_sin[at]),
            layout.split_tensor(apply_rope_half(x_BTHK, llama_cos, llama_sin), r, 1))


def test_causal_visibility_of_a_block_follows_global_positions():
    assert visibility(range(8, 12), range(0, 4)) is Visibility.FULL
    assert visibility(range(8, 12), range(8, 12)) is Visibility.DIAGONAL
    assert visibility(range(8, 12), range(12, 16)) is Visibility.MASKED


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_ranks_compute_the_same_blocks_and_flops_within_one_block(cp: int):
    layout = SequenceLayout(32 * cp, cp)
    shape = {"batch": 2, "heads": 4, "head_dim": 16}
    flops = [attention_flops(layout, r, **shape) for r in range(cp)]
    assert max(flops) - min(flops) <= block_flops(layout, **shape)
    assert flops == [(2 * cp + 1) * block_flops(layout, **shape)] * cp
    # every ring step but the first costs each rank two full blocks, the first a full and two
    # diagonal ones: no rank waits on another's longer step
    for r in range(cp):
        kinds = [sorted(v.value for *_, v in block_plan(layout, r, (r - s) % cp))
                 for s in range(cp)]
        assert kinds == [["diagonal", "diagonal", "full"]] + [["full", "full"]] * (cp - 1)


@pytest.mark.parametrize("cp", [2, 4])
def test_a_contiguous_split_is_unbalanced_by_four_blocks_per_rank(cp: int):
    layout = SequenceLayout(32 * cp, cp, "contiguous")
    shape = {"batch": 1, "heads": 1, "head_dim": 8}
    flops = [attention_flops(layout, r, **shape) for r in range(cp)]
    assert flops == [(4 * r + 3) * block_flops(layout, **shape) for r in range(cp)]
    assert max(flops) - min(flops) > block_flops(layout, **shape)


@pytest.mark.parametrize("exchange", EXCHANGES)
@pytest.mark.parametrize("case", HEADS)
def test_attention_of_a_cp_group_of_one_equals_full_causal_attention(case: str, exchange: str):
    whole, want = attention_tensors(case), serial(case)
    q, k, v = (whole[name].clone().requires_grad_(True) for name in "qkv")
    attend = ContextParallelAttention(SoloGroup(), SequenceLayout(T, 1), exchange)
    out = attend(q, k, v, scale=SCALE)
    out.backward(whole["dout"])
    tolerance = attention_atol(whole["q"], whole["k"], whole["v"], whole["dout"], blocks=2,
                               scale=SCALE)
    for name, got in {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}.items():
        torch.testing.assert_close(got, want[name], rtol=0, atol=tolerance[name])


def refusal(build: Callable[[], object]) -> str:
    with pytest.raises(ContextParallelError) as caught:
        build()
    text = str(caught.value)
    assert MESSAGE.match(text), text
    return text


def test_a_sequence_that_does_not_divide_into_2cp_chunks_is_refused_with_the_nearest_lengths():
    text = refusal(lambda: SequenceLayout(100, 4))
    assert "seq_len 100, cp 4" in text and "2 x cp = 8" in text and "96 or 104" in text


@pytest.mark.parametrize("kwargs", [{"seq_len": 0, "cp": 1}, {"seq_len": 8, "cp": True},
                                    {"seq_len": 8, "cp": 2, "split": "spiral"}])
def test_a_layout_that_is_not_a_layout_is_refused(kwargs: dict):
    refusal(lambda: SequenceLayout(**kwargs))


def test_splitting_joining_or_asking_outside_the_layout_is_refused():
    layout = SequenceLayout(16, 2)
    assert "12 tokens" in refusal(lambda: layout.split_tensor(torch.zeros(1, 12), 0))
    assert "2 parts of 8 tokens" in refusal(lambda: layout.join([torch.zeros(1, 8)]))
    assert "rank 2" in refusal(lambda: layout.positions(2))


def test_attention_dropout_is_refused_until_masks_follow_global_positions():
    attend = ContextParallelAttention(SoloGroup(), SequenceLayout(8, 1))
    x = torch.zeros(1, 2, 8, 4)
    assert "dropout 0.1" in refusal(lambda: attend(x, x, x, dropout_p=0.1))


def test_attention_refuses_a_group_of_another_size_an_unknown_exchange_and_bad_shapes():
    solo = SoloGroup()
    assert "cp = 2" in refusal(lambda: ContextParallelAttention(solo, SequenceLayout(8, 2)))
    refusal(lambda: ContextParallelAttention(solo, SequenceLayout(8, 1), "tree"))
    attend = ContextParallelAttention(solo, SequenceLayout(8, 1))
    q, kv = torch.zeros(1, 6, 8, 4), torch.zeros(1, 4, 8, 4)
    assert "6 query heads" in refusal(lambda: attend(q, kv, kv))
    short = torch.zeros(1, 2, 6, 4)
    assert "8 tokens" in refusal(lambda: attend(short, short, short))


def test_document_ids_that_are_not_the_whole_windows_are_refused():
    attend = ContextParallelAttention(SoloGroup(), SequenceLayout(8, 1))
    x = torch.zeros(1, 2, 8, 4)
    assert "(1, 8)" in refusal(lambda: attend(x, x, x, torch.zeros(1, 4, dtype=torch.int64)))
    assert "integer ids" in refusal(lambda: attend(x, x, x, torch.zeros(1, 8)))


def test_a_masked_blocks_plain_path_equals_the_fused_kernel_and_empty_rows_are_neutral():
    """The plain torch path (what other devices run) against the CPU kernel on one block with
    a document mask in which a query row sees no key: both give that row (0, -inf), and the
    same gradients from a final log-sum-exp (fp64, `attention_atol` of one block)."""
    g = torch.Generator().manual_seed(3)
    b, groups, r, c, k = 2, 2, 2, 4, 8
    q, dout = (torch.randn(b, groups, r, c, k, generator=g, dtype=torch.float64)
               for _ in range(2))
    key, value = (torch.randn(b, groups, c, k, generator=g, dtype=torch.float64)
                  for _ in range(2))
    docs_q, docs_k = torch.tensor([[1, 1, 2, 2], [0, 0, 0, 0]]), torch.tensor([[0, 1, 1, 1],
                                                                              [0, 0, 0, 0]])
    mask = docs_q[:, :, None] == docs_k[:, None, :]
    mask[1, 0] = False  # a row of the second sample that sees nothing either
    plain = block_forward(q, key, value, SCALE, False, mask, fused=False)
    fused = block_forward(q, key, value, SCALE, False, mask, fused=True)
    tol = attention_atol(q.flatten(1, 2), key, value, dout.flatten(1, 2), blocks=1, scale=SCALE)
    empty = ~mask.any(-1)[:, None, None]
    for got in (plain, fused):
        assert bool(got[1][empty.expand_as(got[1])].isneginf().all())
        assert float(got[0][empty[..., None].expand_as(got[0])].abs().max()) == 0.0
    torch.testing.assert_close(plain[0], fused[0], rtol=0, atol=tol["out"])
    seen = ~empty.expand_as(plain[1])
    torch.testing.assert_close(plain[1][seen], fused[1][seen], rtol=0, atol=tol["out"])
    # backward from a final log-sum-exp that is finite on every row (as if merged with the
    # row's other blocks: here all the block's keys) and the output it weights this block by
    final = torch.logsumexp(torch.einsum("bgrqk,bgsk->bgrqs", q, key) * SCALE, -1)
    out = plain[0] * torch.exp(plain[1] - final)[..., None]
    delta = (dout * out).sum(-1)
    want = block_backward(q, key, value, dout, final, delta, SCALE, False, mask)
    got = fused_backward(q, key, value, dout, out, final, SCALE, False, mask)
    for name, w, f in zip(("dq", "dk", "dv"), want, got, strict=True):
        torch.testing.assert_close(f, w, rtol=0, atol=tol[name], msg=name)
