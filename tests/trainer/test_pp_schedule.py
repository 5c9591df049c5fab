"""Pipeline schedules checked without running anything (trainer.parallel.pipeline.schedule / check).

For p in {2, 4} and m in 1..16 every schedule the builders accept passes the static checker
(messages pair up in order, no deadlock under rendezvous p2p, every dependency met, every
microbatch complete), holds at most Megatron's bound of activations per rank, and its ideal run
(F = 1, B = 2, free p2p) has exactly the textbook bubble. Sizes the builders refuse are refused
with a message that says why and what fits. Broken lists are caught by the checker.
"""

from __future__ import annotations

import re

import pytest

from trainer.parallel.pipeline.check import check_schedule
from trainer.parallel.pipeline.schedule import (
    Action,
    Kind,
    ScheduleError,
    batches,
    build,
    gpipe,
    interleaved,
    interleaved_warmup,
    one_f_one_b,
    schedule_table,
    stage_of,
)

PS = (2, 4)
MS = tuple(range(1, 17))
MESSAGE = re.compile(r"^.+ \[.+\]: .+\. .+$")  # <what> [<where>]: <why>. <fix>


def megatron_accepts(p: int, m: int, g: int) -> bool:
    return p <= g <= m and (m % g == 0 or m % g >= p)


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("m", MS)
def test_gpipe_passes_the_checker_and_holds_every_microbatch_at_once(p, m):
    result = check_schedule(gpipe(p, m), p, 1, m=m)
    assert result.max_in_flight == (m,) * p
    assert result.messages == 2 * m * (p - 1)


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("m", MS)
def test_one_f_one_b_passes_the_checker_and_holds_at_most_p_minus_rank(p, m):
    result = check_schedule(one_f_one_b(p, m), p, 1, m=m)
    for rank, held in enumerate(result.max_in_flight):
        assert held <= p - rank
        assert held == min(p - rank, m)


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("v", (1, 2))
def test_interleaved_is_built_exactly_when_megatron_allows_and_then_passes_the_checker(p, m, v):
    if not megatron_accepts(p, m, p):
        with pytest.raises(ScheduleError) as err:
            interleaved(p, m, v)
        assert MESSAGE.match(str(err.value)), str(err.value)
        return
    result = check_schedule(interleaved(p, m, v), p, v, m=m)
    bound = tuple(min(interleaved_warmup(p, r, m, v, p) + 1, m * v) for r in range(p))
    assert result.max_in_flight == bound  # Megatron: warm-up forwards plus the one in flight


@pytest.mark.parametrize(("p", "m", "v", "group"), [(2, 6, 2, 3), (4, 10, 2, 5), (4, 12, 2, 6),
                                                   (4, 16, 3, 8), (2, 10, 2, 4)])
def test_interleaved_with_a_group_larger_than_p_receives_early_and_passes_the_checker(
        p, m, v, group):
    result = check_schedule(interleaved(p, m, v, group), p, v, m=m)
    assert result.max_in_flight[0] == min(interleaved_warmup(p, 0, m, v, group) + 1, m * v)


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("m", (4, 8, 16))
@pytest.mark.parametrize(("name", "v"), [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_the_ideal_run_has_the_textbook_bubble(p, m, name, v):
    result = check_schedule(build(name, p, m, v), p, v, m=m, cost_f=1 / v, cost_b=2 / v)
    assert result.bubble == pytest.approx((p - 1) / (v * m))
    assert result.span == pytest.approx(3 * (m + (p - 1) / v))


def test_one_f_one_b_on_rank_0_of_4_warms_up_with_three_forwards():
    compute = [str(a) for a in one_f_one_b(4, 6)[0] if not a.kind.is_comm]
    assert compute == ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5", "B2", "B3", "B4", "B5"]


def test_interleaved_follows_megatrons_schedule_table_and_maps_chunk_c_of_rank_r_to_stage_cp_r():
    assert schedule_table(6, 2, 4) == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1), (2, 1),
                                       (3, 1), (4, 0), (5, 0), (4, 1), (5, 1)]
    assert [stage_of(r, c, 4) for c in range(2) for r in range(4)] == list(range(8))
    forwards = [(a.microbatch, a.chunk) for a in interleaved(2, 4, 2)[1] if a.kind is Kind.F]
    assert forwards == schedule_table(4, 2, 2)
    assert interleaved_warmup(4, 0, 8, 2, 4) == 10 and interleaved_warmup(4, 3, 8, 2, 4) == 4


def test_consecutive_p2p_actions_form_one_batch():
    rank1 = one_f_one_b(2, 2)[1]
    steps = [[str(a) for a in step] for step in batches(rank1)]
    assert steps == [["RECV_F0<-0"], ["F0"], ["B0"], ["SEND_B0->0", "RECV_F1<-0"], ["F1"],
                     ["B1"], ["SEND_B1->0"]]


@pytest.mark.parametrize(("call", "needle"), [
    (lambda: gpipe(0, 4), "p must be a positive integer"),
    (lambda: one_f_one_b(2, 0), "m must be a positive integer"),
    (lambda: interleaved(2, 4, 0), "v must be a positive integer"),
    (lambda: interleaved(1, 4, 2), "at least 2 ranks"),
    (lambda: interleaved(4, 3, 2), "p <= g <= m (4 <= 4 <= 3 is false"),
    (lambda: interleaved(4, 8, 2, group=3), "a group size of at least p=4"),
    (lambda: interleaved(4, 6, 2), "m % g = 2 is neither 0 nor >= p"),
    (lambda: build("zero-bubble", 2, 4), "the schedules are gpipe, 1f1b and interleaved"),
])
def test_sizes_that_do_not_fit_are_refused_with_the_reason_and_a_fix(call, needle):
    with pytest.raises(ScheduleError) as err:
        call()
    text = str(err.value)
    assert needle in text and MESSAGE.match(text), text


def test_a_microbatch_count_that_breaks_the_group_rule_names_counts_that_fit():
    with pytest.raises(ScheduleError, match=r"e\.g\. 4, 8"):
        interleaved(4, 6, 2)


# -- the checker catches broken lists -------------------------------------------------------


def _replace(lists, rank, index, *new):
    out = [list(lst) for lst in lists]
    out[rank][index:index + 1] = list(new)
    return out


def test_messages_that_pair_up_in_the_wrong_order_are_reported():
    lists = interleaved(2, 4, 2)
    batch = next(i for i, a in enumerate(lists[1]) if a.kind is Kind.SEND_F
                 and lists[1][i + 1].kind is Kind.SEND_B)
    swapped = _replace(lists, 1, batch, lists[1][batch + 1], lists[1][batch])
    del swapped[1][batch + 2]
    with pytest.raises(ScheduleError, match="pair up wrongly.*match in posting order"):
        check_schedule(swapped, 2, 2)


def _waits_for_gradient_before_sending(batched: bool) -> list[list[Action]]:
    """Rank 0 asks for B0's gradient before it sends F0's activation: alone, a wait cycle;
    in the same batch as the send, the pair completes together."""
    recv, send = Action(Kind.RECV_B, 0, 0, 1), Action(Kind.SEND_F, 0, 0, 1)
    rank0 = ([Action(Kind.F, 0), send, recv, Action(Kind.B, 0)] if batched else
             [Action(Kind.F, 0), recv, Action(Kind.B, 0), send])
    rank1 = [Action(Kind.RECV_F, 0, 0, 0), Action(Kind.F, 0), Action(Kind.B, 0),
             Action(Kind.SEND_B, 0, 0, 0)]
    return [rank0, rank1]


def test_a_receive_that_waits_for_what_only_a_later_send_causes_is_a_deadlock_naming_every_rank():
    with pytest.raises(ScheduleError) as err:
        check_schedule(_waits_for_gradient_before_sending(batched=False), 2)
    text = str(err.value)
    assert "schedule deadlocks" in text and MESSAGE.match(text), text
    assert "rank 0 waits at step 1 on RECV_B0<-1" in text
    assert "rank 1 waits at step 0 on RECV_F0<-0" in text


def test_the_same_send_and_receive_posted_as_one_batch_do_not_deadlock():
    assert check_schedule(_waits_for_gradient_before_sending(batched=True), 2).messages == 2


def test_a_forward_without_its_input_is_reported():
    lists = gpipe(2, 2)
    broken = [lists[0], [a for a in lists[1] if str(a) != "RECV_F1<-0"]]
    with pytest.raises(ScheduleError, match="input activation from stage 0 has not been received"):
        check_schedule(broken, 2)


def test_a_backward_before_its_forward_is_reported():
    lists = [[Action(Kind.B, 0), Action(Kind.F, 0)]]
    with pytest.raises(ScheduleError, match="runs before its own forward"):
        check_schedule(lists, 1)


def test_a_send_to_the_wrong_rank_is_reported():
    lists = one_f_one_b(4, 4)
    i = next(i for i, a in enumerate(lists[0]) if a.kind is Kind.SEND_F)
    broken = _replace(lists, 0, i, Action(Kind.SEND_F, 0, 0, 2))
    with pytest.raises(ScheduleError, match="stage 1 runs on rank 1"):
        check_schedule(broken, 4)


def test_a_missing_microbatch_and_a_repeated_forward_are_reported():
    with pytest.raises(ScheduleError, match="B of microbatch 1 .* never runs"):
        check_schedule([[Action(Kind.F, 0), Action(Kind.B, 0), Action(Kind.F, 1)]], 1)
    with pytest.raises(ScheduleError, match="runs twice"):
        check_schedule([[Action(Kind.F, 0), Action(Kind.F, 0)]], 1)


def test_malformed_actions_are_refused_before_simulating():
    with pytest.raises(ScheduleError, match="has the wrong number of ranks"):
        check_schedule(gpipe(2, 2), 4)
    with pytest.raises(ScheduleError, match="chunk 1 is outside 0..0"):
        check_schedule([[Action(Kind.F, 0, 1)]], 1)
    with pytest.raises(ScheduleError, match="peer 5 is not a rank"):
        check_schedule([[Action(Kind.SEND_F, 0, 0, 5)], []], 2)
