"""The pure cores of hang diagnosis, hang detection, stragglers and the live table
(`launcher.hang`), on in-memory rank views."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from launcher.hang.diagnose import diagnose, who
from launcher.hang.status import MAX_RANK_ROWS, render
from launcher.hang.views import GroupView, RankView
from launcher.hang.watch import HangClock, stragglers
from launcher.head.options import SuperviseOptions
from launcher.head.progress import ProgressMonitor
from launcher.launch import HostRequest
from launcher.perf import judge, launch_argv
from launcher.transport.options import SSHOptions
from records import asdict, fields, replace


def rank(r: int, host: str, *groups: GroupView, state: str = "running", step: int = 5,
         avg: float = 0.0) -> RankView:
    return RankView(r, host, pid=1000 + r, state=state, step=step, compute_avg_s=avg,
                    groups=groups)


def op(label: str, grank: int, seq: int, done: int, name: str = "all_reduce", size: int = 2,
       age: float = 10.0, **kw) -> GroupView:
    """A group whose every operation so far was ``name`` (a collective unless point-to-point)."""
    p2p = name in ("send", "recv", "batch_p2p")
    history = tuple((n, name, kw.get("peer", -1), 0 if p2p else n) for n in range(1, seq + 1))
    return GroupView(label, grank, size, seq, done, name, kw.pop("dtype", "float32"),
                     nbytes=kw.pop("nbytes", 1024), age=age, history=history, **kw)


def ar(label: str, grank: int, seq: int, done: int, age: float = 10.0) -> GroupView:
    return op(label, grank, seq, done, age=age)


def barrier(grank: int, seq: int, done: int) -> GroupView:
    return op("world", grank, seq, done, "barrier", size=4, age=11.0, dtype="", nbytes=0)


def skipped_all_reduce() -> list[RankView]:
    """dp 2 x tp 2: rank 2 skipped dp[0]'s all-reduce #4 and waits in the world barrier."""
    return [
        rank(0, "node1", ar("dp[0]", 0, 4, 3, age=12.0), ar("tp[0]", 0, 4, 4), barrier(0, 3, 3)),
        rank(1, "node1", ar("dp[1]", 0, 4, 4), ar("tp[0]", 1, 4, 4), barrier(1, 4, 3)),
        rank(2, "node2", ar("dp[0]", 1, 3, 3), ar("tp[1]", 0, 4, 4), barrier(2, 4, 3)),
        rank(3, "node2", ar("dp[1]", 1, 4, 4), ar("tp[1]", 1, 4, 4), barrier(3, 4, 3)),
    ]


def test_a_rank_that_skipped_an_all_reduce_is_blamed_and_the_rank_waiting_for_it_is_not():
    """Rank 0 waits for rank 2 in dp[0], rank 2 for rank 0 in the world barrier: the cycle is
    broken by the ranks waiting with rank 2 in the barrier, which each entered 4 operations on
    their DP group where rank 2 entered 3."""
    found = diagnose(skipped_all_reduce())
    assert found.culprit_ranks == (2,) and found.blamed_hosts == ("node2",), found.text
    assert (found.kind, found.group, found.op, found.seq) == ("behind", "dp[0]", "all_reduce", 4)
    assert found.headline.startswith("rank 2 (node2) never entered all_reduce #4 on dp[0] "
                                     "(float32, 1.0 KiB), which rank 0 (node1) waits in: it "
                                     "entered 3 operations on dp[0]"), found.text
    assert "now it waits in barrier #4 on world" in found.headline
    assert "  ranks 1 (node1), 3 (node2) wait in barrier #4 on world (for 11.0s) for rank 0 " \
           "(node1): a consequence, not a cause" in found.lines, found.text
    assert "rank 2 (node2): waits in barrier #4 on world" in found.text


def test_a_rank_blocked_in_a_pipeline_receive_names_its_peer_and_the_peer_state():
    recv = op("pp[0]", 0, 7, 6, "batch_p2p", p2p=2, peer=1, nbytes=64, age=9.0)
    views = [rank(0, "node1", recv),
             rank(1, "node2", op("pp[0]", 1, 6, 6, "batch_p2p", age=9.5), state="stopped")]
    found = diagnose(views, {1: "Thread 42 (idle)\n    forward (model.py:10)\n"})
    assert found.culprit_ranks == (1,) and found.kind == "stopped"
    assert found.headline == ("rank 1 (node2) is stopped (SIGSTOP/SIGTSTP); `kill -CONT 1001` "
                              "on its host resumes it; rank 0 (node1) waits for it in batch_p2p "
                              "#7 on pp[0] (float32, 64 B)")
    assert "        forward (model.py:10)" in found.lines  # the stack, indented under it


def test_a_rank_stopped_inside_a_receive_from_a_running_peer_is_still_named_as_stopped():
    waits = op("pp[0]", 1, 7, 6, "batch_p2p", p2p=2, peer=0, nbytes=64, age=9.0)
    views = [rank(0, "node1", op("pp[0]", 0, 6, 6, "batch_p2p", age=9.5)),
             rank(1, "node2", waits, state="stopped")]
    found = diagnose(views)
    assert found.culprit_ranks == (1, 0)
    assert found.headline.startswith("rank 1 (node2) is stopped (SIGSTOP/SIGTSTP); `kill -CONT "
                                     "1001`")
    assert "rank 0 (node1): is in no communication operation" in found.text


def test_two_ranks_each_waiting_to_receive_from_the_other_is_called_a_deadlock():
    views = [rank(r, "n", op("pp[0]", r, 1, 0, "recv", p2p=2, peer=1 - r)) for r in (0, 1)]
    found = diagnose(views)
    assert found.kind == "deadlock" and found.culprit_ranks == (0, 1)
    assert found.headline == ("rank 0 (n) waits in recv #1 on pp[0] for rank 1 (n), which waits "
                              "for it in turn (a deadlock)")


def test_when_every_member_entered_the_operation_nobody_is_blamed():
    views = [rank(r, f"node{r}", ar("dp[0]", r, 9, 8)) for r in (0, 1)]
    found = diagnose(views)
    assert found.culprit_ranks == () and found.blamed_hosts == () and found.kind == "stalled"
    assert found.headline == ("ranks 0 (node0), 1 (node1) wait in all_reduce #9 on dp[0]: every "
                              "member entered it, but it does not complete (a network or device "
                              "problem?)")


def test_a_rank_whose_posted_send_never_arrives_is_blamed_first_and_its_receiver_after_it():
    """Rank 2 sits in its send to rank 0 (posted, running, never completing: its link drops
    what it sends) and rank 0 in the matching receive; ranks 1 and 3 wait in the world barrier
    for both. Every member of the send entered it, yet the sender is the one the job waits for."""
    send = op("world", 2, 7, 6, "send", size=4, p2p=1, peer=0, nbytes=4 << 20, age=9.0)
    recv = op("world", 0, 7, 6, "recv", size=4, p2p=2, peer=2, nbytes=4 << 20, age=9.5)
    views = [rank(0, "node1", recv), rank(1, "node1", barrier(1, 7, 6)),
             rank(2, "node2", send), rank(3, "node2", barrier(3, 7, 6))]
    found = diagnose(views, {2: "Thread 7 (idle)\n    send (worker.py:30)\n"})
    assert found.culprit_ranks == (2,) and found.kind == "unsent", found.text
    assert found.blamed_hosts == ("node2",)
    assert (found.group, found.op, found.seq) == ("world", "send", 7)
    assert found.headline == (
        "rank 2 (node2) is stalled inside send #7 on world (float32, 4.0 MiB) to rank 0 "
        "(node1), which waits in recv #7 on world for it: the posted send never arrives (its "
        "host's network, or the transport under it, does not deliver); ranks 1 (node1), 3 "
        "(node2) wait for it too"), found.text
    assert "every member entered it" not in found.text
    assert any(line.startswith("  ranks 1 (node1), 3 (node2) wait in barrier #7 on world")
               and "a consequence" in line for line in found.lines), found.text
    assert "        send (worker.py:30)" in found.lines


def test_a_send_posted_to_a_stopped_receiver_is_no_stall_of_its_own_the_stop_is_the_cause():
    """Rank 1 is stopped inside its receive of the pipeline's p2p; rank 0 posted the matching
    send, which cannot complete while its receiver is stopped: rank 0 waits for rank 1."""
    send = op("pp[0]", 0, 59, 58, "batch_p2p", size=2, p2p=1, peer=1, nbytes=256 << 10, age=3.5)
    recv = op("pp[0]", 1, 59, 58, "batch_p2p", size=2, p2p=2, peer=0, nbytes=256 << 10, age=3.5)
    views = [rank(0, "node1", send), rank(1, "node2", recv, state="stopped")]
    found = diagnose(views, {})
    assert found.culprit_ranks == (1,) and found.kind == "stopped", found.text
    assert "rank 0 (node1) waits for it in batch_p2p #59 on pp[0]" in found.headline, found.text
    assert "never arrives" not in found.text


def test_a_rank_stopped_inside_an_operation_every_member_entered_is_what_the_others_wait_for():
    views = [rank(0, "node0", ar("dp[0]", 0, 9, 8)),
             rank(1, "node1", ar("dp[0]", 1, 9, 8), state="stopped")]
    found = diagnose(views)
    assert found.culprit_ranks == (1,) and found.kind == "stopped", found.text
    assert found.headline.startswith("rank 1 (node1) is stopped (SIGSTOP/SIGTSTP); `kill -CONT "
                                     "1001` on its host resumes it; rank 0 (node0) waits for it "
                                     "in all_reduce #9 on dp[0]"), found.text
    assert "every member entered it" not in found.text


def test_a_receive_whose_stopped_peer_posted_its_send_waits_for_that_peer():
    views = [rank(0, "node0", op("pp[0]", 0, 7, 6, "recv", p2p=2, peer=1)),
             rank(1, "node1", op("pp[0]", 1, 7, 6, "send", p2p=1, peer=0), state="stopped")]
    found = diagnose(views)
    assert found.culprit_ranks == (1,), found.text
    assert "rank 0 (node0) waits for it in recv #7 on pp[0]" in found.headline, found.text


def test_a_rank_gone_without_a_record_is_what_the_others_wait_for():
    """A torch.distributed rank that left its main before its first record (the Flight
    Recorder's reader writes one a sampling interval after the group is up)."""
    views = [rank(0, "a", op("world", 0, 3, 2, size=3)),
             rank(1, "a", op("world", 1, 3, 2, size=3)), RankView(2, "b", state="exited")]
    found = diagnose(views)
    assert found.culprit_ranks == (2,) and found.kind == "exited", found.text
    assert found.headline.startswith("rank 2 (b) has exited; ranks 0, 1 (a) wait for it in "
                                     "all_reduce #3 on world"), found.text


def test_a_rank_computing_outside_communication_is_blamed_as_behind():
    views = [rank(0, "a", ar("dp[0]", 0, 3, 2)), rank(1, "b", ar("dp[0]", 1, 2, 2, age=4.0))]
    found = diagnose(views)
    assert found.culprit_ranks == (1,) and found.kind == "behind"
    assert found.headline.startswith("rank 1 (b) never entered all_reduce #3 on dp[0] (float32, "
                                     "1.0 KiB), which rank 0 (a) waits in; it is in no "
                                     "communication operation at step 5")
    assert "its last operation, all_reduce #2 on dp[0], began 4.0s ago" in found.text


def test_ranks_are_grouped_by_host_in_messages():
    views = {r: rank(r, "n1" if r < 2 else "n2") for r in range(4)}
    assert who([3, 0, 1], views) == "ranks 0, 1 (n1), 3 (n2)"
    assert who([2], views) == "rank 2 (n2)"


def test_the_hang_clock_fires_once_after_the_timeout_only_while_a_rank_waits():
    waiting = {0: rank(0, "a", ar("dp[0]", 0, 3, 2))}
    computing = {0: rank(0, "a", ar("dp[0]", 0, 3, 3))}
    clock = HangClock(10.0, now=0.0)
    clock.update(computing, 0.0)
    assert not clock.due(computing, 50.0)  # a long phase without communication is no hang
    clock.update(waiting, 50.0)            # it entered an operation: progress
    assert not clock.due(waiting, 59.0)
    assert clock.due(waiting, 60.5)
    clock.fired = True
    assert not clock.due(waiting, 100.0)   # once per stall
    clock.update({0: rank(0, "a", ar("dp[0]", 0, 3, 3))}, 101.0)
    assert not clock.fired and clock.stalled_for(105.0) == 4.0


def test_the_hang_clock_looks_at_most_every_scan_interval_but_never_fires_on_a_stale_look():
    """The head calls `update` once per frame: a look at every view each time cost O(ranks)
    per frame. Views within `SCAN_S` of the last look wait for the next; `due` looks again
    before it fires, so progress seen by no look yet still holds the clock."""
    from launcher.hang.watch import SCAN_S

    before = {0: rank(0, "a", ar("dp[0]", 0, 3, 2))}
    after = {0: rank(0, "a", ar("dp[0]", 0, 4, 3))}  # one more all-reduce done
    clock = HangClock(10.0, now=0.0)
    clock.update(before, 0.0)
    clock.update(after, SCAN_S / 2)         # too soon after the last look: not looked at
    assert clock.last_change == 0.0
    assert not clock.due(after, 10.5)       # looked at now: it advanced, so no hang
    assert clock.stalled_for(10.5) == 0.0
    clock.update(after, 20.0)
    assert clock.due(after, 20.6)           # 10.1 s without progress while it waits


def test_the_hang_clock_looks_only_at_the_views_that_arrived_since_its_last_look():
    """The head names the ranks whose views arrived (`fresh`): a look costs what arrived,
    not every rank of the job; `due` still looks at all of them before it fires."""
    before = {0: rank(0, "a", ar("dp[0]", 0, 3, 2)), 1: rank(1, "b", ar("dp[0]", 1, 3, 2))}
    after = {**before, 1: rank(1, "b", ar("dp[0]", 1, 4, 3))}
    clock = HangClock(10.0, now=0.0)
    fresh = {0, 1}
    clock.update(before, 0.0, fresh)
    assert fresh == set()                   # the look took them
    clock.update(after, 5.0, {0})           # rank 1's new view is not among those named
    assert clock.last_change == 0.0
    clock.update(after, 6.0, {1})
    assert clock.last_change == 6.0
    assert not clock.due(after, 15.0) and clock.due(after, 16.5)


def test_a_rank_working_outside_communication_holds_the_clock_until_it_stops_working():
    """Rank 1 writes a checkpoint (or compiles) while rank 0 waits for it: no hang while it
    uses its core, however long; the timeout runs from when it stops."""
    waits = rank(0, "a", ar("dp[0]", 0, 3, 2))

    def views(share: float, state: str = "running") -> dict[int, RankView]:
        idle = rank(1, "b", ar("dp[0]", 1, 2, 2), state=state)
        return {0: waits, 1: RankView(**{**idle.to_json(), "groups": idle.groups,
                                         "cpu_share": share})}

    clock = HangClock(3.0, now=0.0)
    for t in range(0, 60, 1):
        clock.update(views(0.3), float(t))
        assert not clock.due(views(0.3), float(t))
    clock.update(views(0.001), 60.0)  # it sleeps, or blocks on a lock, since its reading at 59
    assert not clock.due(views(0.001), 61.5) and clock.due(views(0.001), 62.5)
    stopped = HangClock(3.0, now=0.0)
    stopped.update(views(0.9, state="stopped"), 0.0)  # its last reading before SIGSTOP
    assert stopped.due(views(0.9, state="stopped"), 3.5)


def test_torch_ranks_using_their_cpu_inside_a_long_collective_hold_the_clock():
    """Seen through the Flight Recorder, a rank blocks while it waits (gloo does not spin):
    one that uses its CPU inside an all-reduce is moving data."""
    clock = HangClock(3.0, now=0.0)
    views = {r: rank(r, "a", ar("world", r, 4, 3), avg=0.0) for r in (0, 1)}
    moving = {r: replace(v, cpu_share=0.4, recorder="flight") for r, v in views.items()}
    for t in (1.0, 2.0, 3.0, 4.0):
        clock.update(moving, t)
    assert not clock.due(moving, 4.0)
    idle = {r: replace(v, cpu_share=0.01) for r, v in moving.items()}
    clock.update(idle, 5.0)
    assert not clock.due(idle, 6.5) and clock.due(idle, 7.0)  # 3 s after the last work


def test_ranks_spinning_inside_an_operation_are_not_working():
    """MPI spins while it waits: a job whose every rank waits is hung, however busy."""
    spinning = {r: RankView(**{**rank(r, "a").to_json(), "cpu_share": 1.0,
                               "groups": (ar("dp[0]", r, 3, 2),)}) for r in range(2)}
    clock = HangClock(3.0, now=0.0)
    clock.update(spinning, 0.0)
    clock.update(spinning, 2.0)
    assert clock.due(spinning, 3.5)


def test_a_rank_persistently_slower_than_the_median_is_the_only_straggler():
    views = {r: rank(r, "n1" if r < 2 else "n2", avg=0.02 + (0.15 if r == 1 else 0.001 * r))
             for r in range(4)}
    (slow,) = stragglers(views)
    assert (slow.rank, slow.host) == (1, "n1")
    assert slow.describe().startswith("rank 1 (n1) computes 0.170s per step, 7.")
    young = {r: RankView(**{**views[r].to_json(), "groups": (), "step": 2}) for r in views}
    assert stragglers(young) == []  # too few steps to call anyone slow


def test_equal_ranks_with_small_jitter_have_no_straggler():
    views = {r: rank(r, "n", avg=0.010 + 0.002 * r) for r in range(8)}
    assert stragglers(views) == []


def _monitor_after(frames: list[dict[int, float]]) -> ProgressMonitor:
    """A monitor that saw one PROGRESS frame per entry: each rank 10 steps further on, with
    this recent compute average (the records' own, over the last few steps)."""
    monitor = ProgressMonitor(SuperviseOptions(), lambda _: None, lambda _: None, None, 0.0)
    for n, avgs in enumerate(frames, 1):
        monitor.on_progress(0, {"ranks": [rank(r, "n1", step=10 * n, avg=a).to_json()
                                          for r, a in avgs.items()]})
    return monitor


def test_the_end_of_run_straggler_is_the_rank_slow_over_the_whole_run_not_in_its_last_steps():
    slow_all_along = [{0: 0.015, 1: 0.060, 2: 0.017}] * 9 + [{0: 0.015, 1: 0.016, 2: 0.017}]
    (line,) = _monitor_after(slow_all_along).final_report()
    assert line.startswith("straggler: rank 1 (n1) computes 0.056s per step")
    slow_at_the_end = [{0: 0.015, 1: 0.016, 2: 0.017}] * 9 + [{0: 0.015, 1: 0.060, 2: 0.017}]
    assert _monitor_after(slow_at_the_end).final_report() == []


def test_the_live_table_fits_the_width_and_collapses_to_hosts_for_big_jobs():
    views = {v.rank: v for v in skipped_all_reduce()}
    lines = render(views, [], 72)
    assert all(len(line) <= 72 for line in lines)
    assert lines[0].split()[:4] == ["host", "rank", "step", "compute"]
    assert any("node2" in line and "barrier #4" in line for line in lines)
    big = {r: rank(r, f"node{r // 8}", ar("dp[0]", 0, 3, 3)) for r in range(MAX_RANK_ROWS + 8)}
    rows = render(big, [], 100)[1:]
    assert len(rows) == (MAX_RANK_ROWS + 8) // 8 and rows[0].split()[:2] == ["node0", "0-7"]


def test_views_survive_the_json_of_a_progress_frame():
    v = skipped_all_reduce()[1]
    assert RankView.from_json(v.to_json()) == v


def test_a_views_json_holds_its_fields_in_order_and_nothing_else():
    v = skipped_all_reduce()[1]
    assert v.groups
    assert v.to_json() == asdict(v) | {"groups": [asdict(g) for g in v.groups]}
    assert list(v.to_json()) == list(fields(RankView))


def test_perf_check_flags_the_slow_host_and_the_slow_link_only():
    report = judge({"hosts": {"a": 100.0, "b": 96.0, "c": 40.0},
                    "links": [["a", "b", 1.0], ["a", "c", 0.9], ["b", "c", 0.2]]})
    assert report.slow_hosts == ["c"] and report.slow_links == [("b", "c")]
    assert judge({"hosts": {"a": 1.0}, "links": []}).slow_hosts == []  # nothing to compare with


def test_perf_check_launches_one_rank_per_host_on_the_same_hosts_and_ssh_settings():
    argv = launch_argv(HostRequest(hosts="n1:4,n2:4", exclude="n2:3"),
                       SSHOptions(config_file=Path("/c"), accept_new=True), "/py")
    assert argv[argv.index("--nproc-per-node") + 1] == "1"
    assert argv[argv.index("-H") + 1] == "n1:4,n2:4" and argv[argv.index("--exclude") + 1] == \
        "n2:3"
    assert "--ssh-accept-new" in argv and argv[argv.index("--ssh-config") + 1] == "/c"
    assert argv[argv.index("--") + 1:] == ["/py", "-E", "-P", "-m", "trainer.health.perf"]


def test_a_world_of_thousands_blames_its_one_late_rank_in_a_headline_of_one_line():
    """2,048 ranks, 8 per host, wait in all-reduce #10 on the world; rank 77 is in none."""
    views = [rank(r, f"h{r // 8}", op("world", r, 9 if r == 77 else 10, 9, size=2048))
             for r in range(2048)]
    found = diagnose(views)
    assert found.culprit_ranks == (77,) and found.blamed_hosts == ("h9",)
    assert found.headline.startswith("rank 77 (h9) never entered all_reduce #10 on world "
                                     "(float32, 1.0 KiB), which 2047 ranks 0-76, 78-2047 "
                                     "(256 hosts) wait in; it is in no communication operation")


def test_many_ranks_are_named_as_ranges_with_their_host_count():
    views = {r: rank(r, f"n{r % 3}") for r in range(30)}
    assert who([*range(0, 5), *range(6, 20)], views) == "19 ranks 0-4, 6-19 (3 hosts)"
    assert who(range(0, 30, 3), views) == "10 ranks 0, 3, 6, 9, 12, 15, ... (1 host)"


def test_a_program_without_any_record_is_told_by_each_ranks_innermost_frame():
    views = [RankView(0, "a", pid=10, state="no-record"), RankView(1, "b", pid=11,
                                                                    state="no-record")]
    stacks = {0: 'Thread 10 (idle): "MainThread"\n    wait_for (w.py:9)\n    main (w.py:3)\n',
              1: 'Thread 11 (idle): "MainThread"\n    accept (socket.py:294)\n'}
    found = diagnose(views, stacks)
    assert found.culprit_ranks == () and found.kind == "stalled"
    assert found.headline.endswith("every rank sleeps or blocks: rank 0 (a) is in wait_for "
                                   "(w.py:9); rank 1 (b) is in accept (socket.py:294)")
    assert "        wait_for (w.py:9)" in found.lines and "stack of rank 1 (pid 11):" in found.text


def test_the_head_takes_as_many_progress_frames_a_second_at_1024_hosts_as_at_256():
    from launcher.head.progress import PROGRESS_PER_S, sample_interval

    opts = SuperviseOptions()
    assert sample_interval(opts, 1) == sample_interval(opts, 256) == 1.0
    assert 1024 / sample_interval(opts, 1024) == 4096 / sample_interval(opts, 4096) \
        == PROGRESS_PER_S
    # What the user asks for wins: a fifth of --hang-timeout, the live table's interval.
    assert sample_interval(dataclasses.replace(opts, hang_timeout=10.0), 4096) == 2.0
    assert sample_interval(dataclasses.replace(opts, status_interval=0.5), 4096) == 0.5
