"""The trainer's side of restarts (pure parts): the SIGTERM vote, resuming under a restart,
and the layout of a world that shrank."""

from __future__ import annotations

import pytest

from trainer.config.options import make_config, resolve_dp
from trainer.errors import ConfigError
from trainer.stopping.agreement import StopAgreement, reach_seconds
from trainer.training.restart import Restart, announcement, fit_world, of_environ, resuming


class Votes:
    """Every rank's flags, one list per rank; a vote is the MAX over the ranks of one post."""

    def __init__(self, ranks: int) -> None:
        self.posted: list[list[bool]] = [[] for _ in range(ranks)]
        self.read = [0] * ranks

    def of(self, rank: int) -> Votes.One:
        return Votes.One(self, rank)

    class One:
        def __init__(self, votes: Votes, rank: int) -> None:
            self.votes, self.rank = votes, rank

        def post(self, flag: bool) -> None:
            self.votes.posted[self.rank].append(flag)

        def result(self) -> bool:
            n = self.votes.read[self.rank]
            self.votes.read[self.rank] += 1
            return any(flags[n] for flags in self.votes.posted)


def test_ranks_that_see_sigterm_at_different_steps_stop_after_the_same_step():
    votes = Votes(2)
    ranks = [StopAgreement(votes.of(r)) for r in range(2)]
    seen = {0: 5, 1: 6}  # rank 0 notices the signal during step 5, rank 1 during step 6
    stopped = {}
    for step in range(1, 20):
        for r, agreement in enumerate(ranks):
            if r not in stopped and agreement.after(step, step >= seen[r]):
                stopped[r] = step
    assert stopped == {0: 6, 1: 6}  # rank 0's vote of step 5 is read at the end of step 6


def test_a_rank_alone_stops_after_the_step_in_which_it_was_asked():
    agreement = StopAgreement(None)
    assert not agreement.after(1, False) and agreement.after(2, True)


def test_finish_reads_the_vote_still_pending():
    votes = Votes(1)
    agreement = StopAgreement(votes.of(0))
    agreement.after(1, False)
    agreement.finish()
    assert votes.read == [1] and not agreement.pending


def test_the_wait_for_agreement_follows_the_step_time_within_the_grace():
    assert reach_seconds(0.05, 10) == 1.0
    assert reach_seconds(2.0, 10) == 5.0 and reach_seconds(1.0, 10) == 3.0


def test_a_restart_resumes_whatever_the_command_line_says():
    env = {"DTRAIN_RESTART_COUNT": "2", "DTRAIN_RESTART_CAUSE": "host lost: node2",
           "DTRAIN_INITIAL_WORLD_SIZE": "4", "WORLD_SIZE": "3"}
    restart = of_environ(env)
    assert restart == Restart(2, "host lost: node2", 4)
    cfg = resuming(make_config({}, {}), restart)
    assert cfg.checkpoint.resume and cfg.checkpoint.resume_fallback
    assert of_environ({"DTRAIN_RESTART_COUNT": "0"}) is None and of_environ({}) is None
    assert announcement(restart, 30) == (
        "dtrain: resumed at step 30 after restart 2 (cause: host lost: node2)")
    assert "restarted at step 0 after restart 2 (no checkpoint yet" in announcement(restart, 0)


def _fit(world: int, initial: int = 4, **train):
    cfg = make_config({"model": "tiny", **train}, {})
    fitted, active = fit_world(cfg, world, Restart(1, "x", initial))
    return resolve_dp(fitted, active), active


def test_a_smaller_world_keeps_the_global_batch_with_more_microbatches_per_rank():
    cfg, active = _fit(3, global_batch=12)  # dp 4 took 3 each; dp 3: 4 each, 2 + 2
    assert (cfg.parallel.dp, cfg.parallel.microbatches, active) == (3, 2, 3)
    cfg, active = _fit(3, global_batch=8)  # 8 does not split over 3: dp 2, one rank stands by
    assert (cfg.parallel.dp, cfg.parallel.microbatches, cfg.data.global_batch, active) == (
        2, 2, 8, 2)
    cfg, active = _fit(2, global_batch=16, microbatches=2)  # 2 per microbatch: 4 of them
    assert (cfg.parallel.dp, cfg.parallel.microbatches, active) == (2, 4, 2)


def test_a_world_that_did_not_shrink_is_left_alone():
    cfg = make_config({"model": "tiny", "global_batch": 8}, {})
    assert fit_world(cfg, 4, Restart(1, "x", 4)) == (cfg, 4)
    assert fit_world(cfg, 4, None) == (cfg, 4)


def test_a_layout_that_fits_no_smaller_world_is_refused_once_with_the_fix():
    with pytest.raises(ConfigError, match=r"the layout does not fit the smaller world "
                       r"\[restart 1: 1 of 4 ranks\]: one model copy takes tp\*pp = 2"):
        _fit(1, tp=2, global_batch=8)


def test_a_smaller_world_keeps_whole_context_parallel_groups():
    """cp 2 over 8 ranks (dp 4) restarted on 5: dp 2 of cp 2 train, the fifth rank stands by."""
    cfg, active = _fit(5, initial=8, global_batch=8, cp=2)
    assert (cfg.parallel.dp, cfg.parallel.cp, active) == (2, 2, 4)
