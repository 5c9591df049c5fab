"""A save's MB/s is taken over the seconds it was writing (`trainer.checkpoint.rate.busy`):
every moment some rank writes, and everything from the last write to the commit's end; not
the time the late ranks were still computing their step while nobody wrote."""

from __future__ import annotations

import pytest

from trainer.checkpoint.rate import busy


def test_overlapping_writes_count_once_and_the_commit_after_the_last_write_counts() -> None:
    # Two ranks write at once (0-3, 1-4), the commit ends at 6: 0..6.
    assert busy([(0.0, 3.0), (1.0, 4.0)], 6.0) == pytest.approx(6.0)


def test_a_stretch_when_no_rank_writes_while_a_late_rank_computes_is_not_counted() -> None:
    # Rank 0 writes 0-2; rank 1 reaches the save at 5 and writes 5-7; commit ends at 8.
    assert busy([(0.0, 2.0), (5.0, 7.0)], 8.0) == pytest.approx(5.0)


def test_a_write_inside_another_and_the_agreement_before_the_commit_both_count() -> None:
    # 1-2 lies inside 0-4; nobody writes from 4 to the commit's end at 4.5, which counts.
    assert busy([(0.0, 4.0), (1.0, 2.0)], 4.5) == pytest.approx(4.5)


def test_a_save_with_no_write_took_no_writing_time() -> None:
    assert busy([], 3.0) == 0.0
