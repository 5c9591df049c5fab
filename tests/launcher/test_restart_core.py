"""The pure cores of restart rounds: the policy, blame, spares and exclusion, goodput."""

from __future__ import annotations

import json
import signal

import pytest

from launcher.errors import HostfileError, UsageError
from launcher.head.outcome import Failure, JobOutcome, RankOutcome
from launcher.hosts.hostfile import parse_hostfile_text
from launcher.hosts.selection import select_hosts
from launcher.restart import goodput
from launcher.restart.blame import Blame, blame
from launcher.restart.goodput import RoundRecord
from launcher.restart.policy import RestartOptions, RoundEnd, backoff, decide, parse_codes
from launcher.restart.pool import HostPool, JobEnds, NextRound, split_spares

OPTS = RestartOptions(max_restarts=3)


# -- policy ------------------------------------------------------------------------------------
def test_a_rank_failure_restarts_while_the_budget_lasts():
    assert decide(RoundEnd(1), OPTS, 0).restart
    assert decide(RoundEnd(137), OPTS, 2).restart
    spent = decide(RoundEnd(137), OPTS, 3)
    assert not spent.restart and "budget is spent (3 of --max-restarts 3)" in spent.why


@pytest.mark.parametrize("end, why", [
    (RoundEnd(0), "every rank exited 0"),
    (RoundEnd(130, interrupted_by=signal.SIGINT), "interrupted by SIGINT"),
    (RoundEnd(143, interrupted_by=signal.SIGTERM), "interrupted by SIGTERM"),
    (RoundEnd(129, interrupted_by=signal.SIGHUP), "interrupted by SIGHUP"),
    (RoundEnd(124, timed_out=True), "--timeout"),
    (RoundEnd(2), "exit code 2 is permanent (--no-restart-on 2)"),
])
def test_these_endings_never_restart(end, why):
    decision = decide(end, OPTS, 0)
    assert not decision.restart and why in decision.why


def test_no_restart_on_takes_a_list_of_codes_or_none():
    assert parse_codes("2, 3") == {2, 3} and parse_codes("none") == frozenset()
    assert decide(RoundEnd(2), RestartOptions(max_restarts=1, no_restart_on=frozenset()), 0
                  ).restart
    with pytest.raises(ValueError, match="'x' is not an exit code"):
        parse_codes("2,x")


def test_the_back_off_doubles_up_to_its_cap():
    opts = RestartOptions(max_restarts=9, backoff=2.0)
    assert [backoff(opts, k) for k in (1, 2, 3, 7)] == [2.0, 4.0, 8.0, 60.0]
    assert backoff(RestartOptions(backoff=0), 3) == 0.0
    assert backoff(RestartOptions(backoff=90), 2) == 90.0


# -- blame -------------------------------------------------------------------------------------
def _outcome(hosts: dict[int, str]) -> JobOutcome:
    return JobOutcome({r: RankOutcome(r, h, state="stopped") for r, h in hosts.items()})


HOSTS = {0: "node1", 1: "node1", 2: "node2", 3: "node3"}


def test_a_rank_killed_by_a_signal_blames_its_host_which_stays():
    out = _outcome(HOSTS)
    out.ranks[2].signal = signal.SIGKILL
    out.record_failure(Failure(137, "rank 2@node2", "killed by SIGKILL"))
    assert blame(out) == Blame("rank killed by SIGKILL", ("node2",), (),
                               "rank 2@node2: killed by SIGKILL")


def test_the_first_rank_that_exited_non_zero_is_blamed_not_the_ranks_stopped_after_it():
    out = _outcome(HOSTS)
    out.record_failure(Failure(7, "rank 3@node3", "exited with code 7"))
    out.record_failure(Failure(1, "rank 0@node1", "exited with code 1"))
    found = blame(out)
    assert found is not None and found.cause == "rank exited 7" and found.hosts == ("node3",)


def test_a_lost_host_is_blamed_and_must_leave():
    out = _outcome(HOSTS)
    out.record_failure(Failure(255, "host node2", "no heartbeat for 3.1s"))
    found = blame(out, lost={"node2"})
    assert found is not None and (found.cause, found.hosts, found.leave) == (
        "host lost", ("node2",), ("node2",))


def test_a_hang_blames_the_hosts_of_the_ranks_the_diagnosis_names():
    out = _outcome(HOSTS)
    out.record_failure(Failure(123, "rank 3@node3", "hung (...); stopped by --hang-action abort"))
    found = blame(out, hung=[3])
    assert found is not None and (found.cause, found.hosts, found.leave) == (
        "hang", ("node3",), ("node3",))


def test_an_mpi_abort_blames_the_aborting_ranks_host():
    out = _outcome(HOSTS)
    out.abort = Failure(5, "rank 1@node1", "MPI_Abort: boom")
    found = blame(out)
    assert found is not None and (found.cause, found.hosts, found.leave) == (
        "MPI_Abort", ("node1",), ())


def test_a_round_without_a_failure_blames_nobody():
    assert blame(_outcome(HOSTS)) is None


# -- spares and exclusion ----------------------------------------------------------------------
def _selected(text: str):
    return select_hosts(parse_hostfile_text(text, "hf"))


def test_hosts_marked_spare_and_the_last_spares_k_stand_by():
    sel = _selected("node1 slots=2\nnode2 slots=2 spare\nnode3 slots=2\nnode4 slots=2\n")
    active, spares = split_spares(sel, 0)
    assert [h.entry.name for h in active] == ["node1", "node3", "node4"]
    assert [h.entry.name for h in spares] == ["node2"]
    active, spares = split_spares(sel, 1)
    assert [h.entry.name for h in active] == ["node1", "node3"]
    assert [h.entry.name for h in spares] == ["node4", "node2"]


def test_spare_is_a_mark_and_every_host_spare_is_refused():
    with pytest.raises(HostfileError, match="spare appears twice"):
        parse_hostfile_text("node1 spare spare\n", "hf")
    with pytest.raises(UsageError, match="every host is marked spare"):
        split_spares(_selected("node1 spare\n"), 0)
    with pytest.raises(UsageError, match="only 2 host"):
        split_spares(_selected("a\nb\n"), 2)


def _pool(text: str, **kw) -> HostPool:
    return HostPool(*split_spares(_selected(text), 0), **kw)


def _names(step: NextRound | JobEnds) -> list[str]:
    assert isinstance(step, NextRound), step
    return [h.entry.name for h in step.hosts]


LOST2 = Blame("host lost", ("node2",), ("node2",), "host node2: no heartbeat")
CRASH2 = Blame("rank exited 1", ("node2",), (), "rank 2@node2: exited with code 1")


def test_a_lost_host_is_replaced_in_its_place_by_a_spare_with_enough_slots():
    pool = _pool("node1:2\nnode2:2\nnode3:2\nsmall:1 spare\nbig:4 spare\nfit:2 spare\n")
    step = pool.next_round(LOST2)
    assert _names(step) == ["node1", "fit", "node3"]
    assert isinstance(step, NextRound) and step.replaced == (("node2", "fit"),)
    again = pool.next_round(Blame("host lost", ("fit",), ("fit",), ""))
    assert _names(again) == ["node1", "big", "node3"] and again.hosts[1].slots == (0, 1)


def test_a_crash_restarts_on_the_same_hosts_until_the_host_is_blamed_twice():
    pool = _pool("node1\nnode2\nnode3\nnode4 spare\n")
    assert _names(pool.next_round(CRASH2)) == ["node1", "node2", "node3"]
    assert _names(pool.next_round(CRASH2)) == ["node1", "node4", "node3"]
    assert pool.excluded == {"node2"}


def test_without_a_spare_min_nodes_lets_the_job_go_on_smaller():
    pool = _pool("node1\nnode2\nnode3\nnode4\n", min_nodes=2)
    step = pool.next_round(LOST2)
    assert _names(step) == ["node1", "node3", "node4"]
    assert isinstance(step, NextRound) and "without node2" in step.describe()
    # node2 was not excluded: at the next loss it is the spare (connected again then)
    assert _names(pool.next_round(Blame("host lost", ("node3",), ("node3",), ""))) == [
        "node1", "node2", "node4"]


def test_without_a_spare_a_lost_host_is_used_again_and_a_host_blamed_twice_ends_the_job():
    pool = _pool("node1\nnode2\n")
    step = pool.next_round(LOST2)
    assert _names(step) == ["node1", "node2"] and isinstance(step, NextRound)
    assert step.kept == ("node2",)
    ends = pool.next_round(CRASH2)
    assert isinstance(ends, JobEnds)
    assert "host node2 was blamed 2 times" in ends.why and "--spares K" in ends.why


def test_a_host_that_left_without_exclusion_is_the_last_spare_and_exclude_after_0_never_excludes():
    pool = _pool("node1\nnode2\nnode3 spare\n", exclude_after=0)
    assert _names(pool.next_round(LOST2)) == ["node1", "node3"]
    assert [s.entry.name for s in pool.spares] == ["node2"]  # back when its turn comes
    lost3 = Blame("host lost", ("node3",), ("node3",), "")
    assert _names(pool.next_round(lost3)) == ["node1", "node2"]
    for _ in range(5):
        assert isinstance(pool.next_round(CRASH2), NextRound)
    assert not pool.excluded


def test_a_spare_whose_check_of_the_job_failed_takes_no_place():
    pool = _pool("node1\nnode2\nnode3 spare\n")
    assert pool.refuse_spare("node3") and not pool.refuse_spare("node3")
    assert _names(pool.next_round(LOST2)) == ["node1", "node2"]


def test_a_spare_whose_agent_is_gone_still_takes_a_place_before_the_job_gives_up():
    pool = _pool("node1\nnode2\nnode3 spare\n", exclude_after=1)
    pool.lose_spare("node3")  # fell silent: it is connected again when it takes the place
    nxt = pool.next_round(LOST2)
    assert isinstance(nxt, NextRound) and nxt.replaced == (("node2", "node3"),)


def test_a_spare_with_a_live_agent_is_taken_before_one_whose_agent_is_gone():
    pool = _pool("node1\nnode2\nnode3 spare\nnode4 spare\n")
    pool.lose_spare("node3")
    assert _names(pool.next_round(LOST2)) == ["node1", "node4"]
    pool.lose_spare("node1")  # a host of the round is no spare: nothing to mark
    pool.spare_back("node3")
    assert pool.gone == set()


def test_min_nodes_above_the_hosts_is_refused():
    with pytest.raises(UsageError, match="the job starts on 2 host"):
        _pool("a\nb\nc spare\n", min_nodes=3)


# -- goodput -----------------------------------------------------------------------------------
def test_each_failure_gets_a_row_and_goodput_counts_only_kept_steps():
    first = RoundRecord(0, ("node1",), started_at=0.0, running_at=1.0, first_step=1,
                        trained_at=2.0, last_step=11, last_step_at=12.0, failed_at=12.5,
                        detected_at=13.0, stopped_at=14.0, exit_code=255, cause="host lost",
                        blamed=("node2",), change="node4 replaces node2")
    second = RoundRecord(1, ("node1",), started_at=15.0, running_at=16.0, first_step=9,
                         trained_at=18.0, last_step=20, last_step_at=29.0)
    rep = goodput.report([first, second], wall_s=30.0)
    [row] = rep.rows
    assert (row.detect_s, row.stop_s, row.restart_s, row.resume_s, row.steps_repeated) == (
        0.5, 1.0, 2.0, 2.0, 3)
    # kept: steps 1..8 of round 0 at 1 s each, steps 9..20 of round 1 at 1 s each
    assert rep.kept_s == pytest.approx(20.0) and rep.goodput == pytest.approx(20 / 30)
    text = goodput.render(rep)
    assert text[0].split() == ["round", "cause", "blamed", "code", "detect", "stop", "restart",
                               "resume", "repeated", "next", "round"]
    assert "host lost" in text[1] and "node4 replaces node2" in text[1]
    assert text[-1].startswith("goodput 66.7% (20.0s on kept steps of 30.0s wall), 1 restart")
    body = json.loads(goodput.dumps(rep))
    assert body["restarts"] == 1 and body["failures"][0]["steps_repeated"] == 3


def test_a_program_without_progress_records_has_no_goodput():
    rep = goodput.report([RoundRecord(0, ("h",), 0.0, exit_code=1, cause="rank exited 1")],
                         wall_s=5.0)
    assert rep.goodput is None and goodput.render(rep)[-1] == "0 restarts, wall 5.0s"
