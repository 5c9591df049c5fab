"""`bench.flight` on its smallest configuration: one seeded fault on 4 gloo ranks is named
first and within the hang timeout's reach; one pair of recorder-cost runs gives both sides."""

from __future__ import annotations

from bench import flight


def test_one_seeded_skip_on_four_gloo_ranks_names_its_culprit_first():
    row = flight.diagnose_run("skip", 3, 4, 3.0)
    assert row["exit_code"] == 123 and row["culprit"] is not None, row
    assert row["named_first"] == row["culprit"], row
    assert row["diagnosis_after_s"] is not None and row["diagnosis_after_s"] > 3.0, row


def test_the_recorder_cost_run_times_both_sides():
    row = flight.recorder_cost(1)
    assert row["bare_ms"] > 0 and row["recorded_ms"] > 0 and "overhead_pct" in row, row
