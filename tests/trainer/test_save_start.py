"""A save's first phase agrees on everything in one collective (the weights' check, AdamW's
step count, the leader's folder): a non-finite weight on any rank still stops every rank
before anything is written, and leaves no folder behind. A background save posts that
agreement without waiting and reads it at the next step's end (the folder named by a token
agreed at start-up): a non-finite weight on any rank still stops every rank, before the
commit, and leaves no folder. A save in place (and the last save) agrees on them in the one
collective after the writes instead: a non-finite weight on any rank stops every rank before
the commit and leaves no folder. The ranks: `tests.support.save_agreement_worker`."""

from __future__ import annotations

from tests.support.mpi_runs import world_run


def test_a_nonfinite_weight_on_one_rank_stops_every_rank_and_leaves_no_folder() -> None:
    ranks = world_run("tests.support.save_agreement_worker:run_begin", 2).ranks
    for got in ranks:
        assert got["refused"].startswith("training diverged [step 1]: a parameter is NaN or "
                                         "infinite after the update"), got["refused"]
    assert ranks[0]["left"] == [], ranks[0]["left"]


def test_the_save_begun_after_it_commits_with_the_step_count_agreed() -> None:
    ranks = world_run("tests.support.save_agreement_worker:run_begin", 2).ranks
    assert [got["saved"] for got in ranks] == ["step-1", "step-1"]
    assert ranks[0]["adam_step"] == 1


def test_a_background_save_reads_its_agreement_at_the_next_step_end_and_a_bad_rank_still_stops_it(
) -> None:
    ranks = world_run("tests.support.save_agreement_worker:run_late", 2).ranks
    assert all(got["returned"] for got in ranks)  # the save itself agreed on nothing
    for got in ranks:
        assert got["refused"].startswith("training diverged [step 1]: a parameter is NaN or "
                                         "infinite after the update"), got["refused"]
    assert ranks[0]["left"] == [], ranks[0]["left"]  # its folder removed, nothing committed


def test_a_background_save_commits_with_the_step_count_agreed_late_and_no_record_left_behind(
) -> None:
    ranks = world_run("tests.support.save_agreement_worker:run_late", 2).ranks
    assert all(got["committed"] == [True, True] for got in ranks)
    assert ranks[0]["adam_step"] == 5  # rank 1's count, the MAX, in the leader's meta
    assert 2 <= ranks[0]["polls"] <= 6  # step 1 finished by votes: write, then commit
    # The records the ranks left for the leader are gone, whether the votes moved the save on
    # (step 1) or close settled it collectively (step 2): each folder holds what it always did.
    for files in ranks[0]["files"]:
        assert files == ["COMMITTED", "index.json", "meta.json", "rank-00000.safetensors",
                         "rank-00001.safetensors", "rng.safetensors"], files


def test_a_save_in_place_agrees_with_its_writes_and_a_bad_rank_still_stops_it_before_the_commit(
) -> None:
    ranks = world_run("tests.support.save_agreement_worker:run_in_place", 2).ranks
    for got in ranks:
        assert got["refused"].startswith("training diverged [step 1]: a parameter is NaN or "
                                         "infinite after the update"), got["refused"]
    assert ranks[0]["left"] == [], ranks[0]["left"]  # written, then removed: nothing committed


def test_a_save_in_place_commits_with_the_step_count_agreed_and_no_record_left_behind() -> None:
    ranks = world_run("tests.support.save_agreement_worker:run_in_place", 2).ranks
    assert all(got["committed"] for got in ranks)
    assert ranks[0]["adam_step"] == 5  # rank 1's count, the MAX, in the leader's meta
    for got in ranks:
        assert got["files"] == ["COMMITTED", "index.json", "meta.json", "rank-00000.safetensors",
                                "rank-00001.safetensors", "rng.safetensors"], got["files"]
    [report] = ranks[0]["reports"]  # the leader's: every rank's bytes, over the save's seconds
    assert report["step"] == 1 and len(report["rank_mb"]) == 2
    assert report["mb"] == round(sum(report["rank_mb"]), 3) > 0 and report["seconds"] > 0
