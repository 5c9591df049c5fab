"""The head's key-value space: barriers combined across hosts, gets, aborts."""

from __future__ import annotations

import pytest

from launcher.errors import PmiError
from launcher.pmi.kvs import KeyValueSpace


def barrier(kvs: KeyValueSpace, host: int, **puts: str) -> list:
    return kvs.handle(host, {"op": "barrier_in", "puts": puts})


def test_the_barrier_completes_when_the_last_host_enters():
    kvs = KeyValueSpace(hosts=3, kvsname="k")
    assert barrier(kvs, 0, a="1") == []
    assert barrier(kvs, 2, c="3") == []
    assert kvs.waiting_hosts() == [1]
    out = barrier(kvs, 1, b="2")
    kv = {"a": "1", "c": "3", "b": "2"}
    assert out == [(h, {"op": "barrier_out", "kv": kv}) for h in range(3)]
    assert kvs.epoch == 1 and kvs.waiting_hosts() == []


def test_each_barrier_out_carries_only_that_epochs_puts():
    kvs = KeyValueSpace(hosts=1, kvsname="k")
    barrier(kvs, 0, a="1")
    assert barrier(kvs, 0, b="2") == [(0, {"op": "barrier_out", "kv": {"b": "2"}})]


def test_a_get_is_answered_from_committed_keys_only():
    kvs = KeyValueSpace(hosts=2, kvsname="k")
    barrier(kvs, 0, a="1")
    assert kvs.handle(1, {"op": "get", "key": "a", "req": 5}) == [
        (1, {"op": "get_result", "req": 5, "found": False, "value": ""})]
    barrier(kvs, 1)
    assert kvs.handle(1, {"op": "get", "key": "a", "req": 6}) == [
        (1, {"op": "get_result", "req": 6, "found": True, "value": "1"})]


def test_a_conflicting_put_is_last_writer_wins_and_recorded():
    kvs = KeyValueSpace(hosts=2, kvsname="k")
    barrier(kvs, 0, a="1")
    barrier(kvs, 1, a="2")
    assert kvs.get("a") == "2" and kvs.conflicts == ["a"]


def test_the_same_value_put_twice_is_not_a_conflict():
    kvs = KeyValueSpace(hosts=2, kvsname="k")
    barrier(kvs, 0, a="1")
    barrier(kvs, 1, a="1")
    assert kvs.conflicts == []


def test_the_first_abort_is_kept():
    kvs = KeyValueSpace(hosts=2, kvsname="k")
    assert kvs.aborted is None
    assert kvs.handle(1, {"op": "abort", "rank": 3, "code": 42, "message": "abort"}) == []
    kvs.handle(0, {"op": "abort", "rank": 0, "code": 1, "message": "later"})
    assert kvs.aborted == (3, 42, "abort")


@pytest.mark.parametrize("host, msg, why", [
    (2, {"op": "get", "key": "a", "req": 1}, "host index 2 outside 0..1"),
    (0, {"op": "nope"}, "unknown op 'nope' from host 0"),
    (0, {"op": "barrier_in"}, "without a string-to-string puts object"),
    (0, {"op": "barrier_in", "puts": {"a": 1}}, "without a string-to-string puts object"),
])
def test_a_malformed_relay_message_is_rejected_as_a_dtrain_bug(host, msg, why):
    with pytest.raises(PmiError, match=why):
        KeyValueSpace(hosts=2, kvsname="k").handle(host, msg)


def test_a_host_entering_the_same_barrier_twice_is_rejected():
    kvs = KeyValueSpace(hosts=2, kvsname="k")
    barrier(kvs, 0)
    with pytest.raises(PmiError, match="host 0 entered barrier 0 twice"):
        barrier(kvs, 0)


@pytest.mark.parametrize("driver", ["run_cores", "run_sockets"])
def test_a_barrier_costs_two_head_messages_per_host_whatever_the_rank_count(driver):
    from bench import pmi_scaling  # the simulated MPICH clients of the scaling bench

    row = getattr(pmi_scaling, driver)(64)
    assert (row["ranks"], row["hosts"], row["barriers"]) == (64, 8, 2)
    assert row["head_msgs_per_barrier"] == 2 * 8
    assert row["upstream_gets"] == 0  # every get after a barrier is served by the proxy


def test_a_fence_whose_cards_exceed_the_push_limit_announces_them_and_serves_gets_and_fetches():
    kvs = KeyValueSpace(hosts=2, kvsname="k", push_bytes=4)
    barrier(kvs, 0, a="1")
    out = barrier(kvs, 1, bb="22")  # 2 + 4 bytes of keys and values: over the limit
    assert out == [(h, {"op": "barrier_out", "kv": {}, "held": 6}) for h in range(2)]
    assert kvs.handle(0, {"op": "get", "key": "bb", "req": 3}) == [
        (0, {"op": "get_result", "req": 3, "found": True, "value": "22"})]
    # A fetch's answer names no request: the same for every host until the next fence.
    for host in range(2):
        assert kvs.handle(host, {"op": "fetch"}) == [
            (host, {"op": "cards", "kv": {"a": "1", "bb": "22"}})]
    # A fence without puts (MPI_Finalize's) carries nothing either way.
    barrier(kvs, 0)
    assert barrier(kvs, 1) == [(h, {"op": "barrier_out", "kv": {}}) for h in range(2)]


def test_a_fences_cards_go_to_every_host_while_cards_times_hosts_stay_within_the_push_budget():
    kvs = KeyValueSpace(hosts=4, kvsname="k", push_bytes=24)
    for h in range(3):
        barrier(kvs, h)
    out = barrier(kvs, 3, abc="def")  # 6 bytes to each of 4 hosts: 24, within the budget
    assert out == [(h, {"op": "barrier_out", "kv": {"abc": "def"}}) for h in range(4)]
    for h in range(3):
        barrier(kvs, h)
    out = barrier(kvs, 3, abcd="def")  # 7 bytes x 4 hosts: 28, over it
    assert out == [(h, {"op": "barrier_out", "kv": {}, "held": 7}) for h in range(4)]
