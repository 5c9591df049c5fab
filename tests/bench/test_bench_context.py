"""The context-parallel bench in a small configuration (`bench.context`): well-formed rows, and
the bytes one rank sends per layer equal the analytic count exactly (they are counted, not
timed); activation memory per rank at cp 2 and 4 within 10% of cp 1's divided by cp. Times are
never asserted. With ``train_longest`` the estimated longest sequence for a small budget is
then trained at cp 1 and cp 4, and its measured activation peak per rank stays within the
budget."""

from __future__ import annotations

import json

import pytest

from bench import context


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return context.run(seq_len=256, steps=1, budget_mb=BUDGET_MB, train_longest=1)


BUDGET_MB = 4.0


def test_every_variant_has_a_row_with_its_numbers(rows: list[dict]) -> None:
    assert [r["variant"] for r in rows] == list(context.VARIANTS)
    for row in rows:
        assert row["step_ms"] > 0 and row["act_mb"] > 0 and row["longest_seq"] > 0
    json.dumps(rows)


def test_each_rank_sends_exactly_the_analytic_bytes_per_layer(rows: list[dict]) -> None:
    for row in rows:
        assert row["fwd_mb"] == pytest.approx(row["fwd_analytic_mb"], rel=1e-12), row
        assert row["bwd_mb"] == pytest.approx(row["bwd_analytic_mb"], rel=1e-12), row


def test_activation_memory_per_rank_is_within_ten_percent_of_one_over_cp(rows: list[dict]
                                                                          ) -> None:
    for row in rows[1:]:
        assert 0.9 <= row["act_vs_analytic"] <= 1.1, row


def test_the_longest_sequence_for_the_budget_trains_within_it_and_cp4s_is_longer(
        rows: list[dict]) -> None:
    trained = {r["variant"]: r for r in rows if "trained_seq" in r}
    assert set(trained) == set(context.TRAINED)
    for row in trained.values():
        assert row["trained_seq"] == row["longest_seq"] > 256
        assert 0 < row["trained_act_mb"] <= BUDGET_MB, row
    assert trained["cp4 allgather"]["trained_seq"] > 3 * trained["cp1"]["trained_seq"]
