"""The per-host PMI proxy core, driven line by line as MPICH's client drives it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from launcher.errors import PmiError
from launcher.pmi.actions import (
    Abort,
    Close,
    RankFailed,
    Reply,
    Send,
    is_allgather_key,
    shm_segment_prefixes,
)
from launcher.pmi.proxy import DENSE_GETS, GET_COST_BYTES, PmiProxy

MAPPING = "(vector,(0,2,2))"


def make_proxy(ranks=(2, 3), tokens=None) -> PmiProxy:
    return PmiProxy(ranks=ranks, world_size=4, kvsname="kvs_7", process_mapping=MAPPING,
                    id_tokens=tokens)


def ask(proxy: PmiProxy, conn: int, line: str) -> list:
    return proxy.feed(conn, line.encode() + b"\n")


def reply_of(actions: list) -> str:
    assert len(actions) == 1 and isinstance(actions[0], Reply), actions
    return actions[0].data.decode()


def started(proxy: PmiProxy, conn: int, rank: int) -> None:
    assert proxy.open(conn, rank) == []
    assert "rc=0" in reply_of(ask(proxy, conn, "cmd=init pmi_version=1 pmi_subversion=1"))


def closed_with_failure(actions: list, conn: int, rank: int) -> str:
    kinds = [type(a) for a in actions]
    assert kinds == [Close, RankFailed], actions
    assert actions[0].conn == conn and actions[1].rank == rank
    return actions[1].reason


# ----- serving locally ----------------------------------------------------------------------

def test_init_is_answered_with_pmi_1_1():
    proxy = make_proxy()
    proxy.open(1, 2)
    assert reply_of(ask(proxy, 1, "cmd=init pmi_version=1 pmi_subversion=1")) == \
        "cmd=response_to_init rc=0 pmi_version=1 pmi_subversion=1\n"


@pytest.mark.parametrize("line, expected", [
    ("cmd=get_maxes", "cmd=maxes rc=0 kvsname_max=256 keylen_max=64 vallen_max=1024\n"),
    ("cmd=get_appnum", "cmd=appnum rc=0 appnum=0\n"),
    ("cmd=get_my_kvsname", "cmd=my_kvsname rc=0 kvsname=kvs_7\n"),
    ("cmd=get_universe_size", "cmd=universe_size rc=0 size=4\n"),
    ("cmd=get kvsname=kvs_7 key=PMI_process_mapping",
     f"cmd=get_result rc=0 value={MAPPING}\n"),
    ("cmd=get kvsname=kvs_7 key=universeSize", "cmd=get_result rc=0 value=4\n"),
    ("cmd=get kvsname=kvs_7 key=PMI_hwloc_xmlfile", "cmd=get_result rc=1 msg=not_available\n"),
    ("cmd=finalize", "cmd=finalize_ack rc=0\n"),
])
def test_job_queries_are_answered_locally(line, expected):
    proxy = make_proxy()
    started(proxy, 1, 2)
    assert reply_of(ask(proxy, 1, line)) == expected


@pytest.mark.parametrize("mapping", ["", "(vector," + "(0,1,1)," * 200 + "(0,1,1))"])
def test_an_empty_or_over_long_process_mapping_is_answered_as_absent(mapping):
    proxy = PmiProxy(ranks=[0], world_size=1, kvsname="k", process_mapping=mapping)
    started(proxy, 1, 0)
    assert "rc=1" in reply_of(ask(proxy, 1, "cmd=get kvsname=k key=PMI_process_mapping"))


def test_a_put_is_acknowledged_at_once_and_served_from_the_local_cache():
    proxy = make_proxy()
    started(proxy, 1, 2)
    started(proxy, 2, 3)
    assert reply_of(ask(proxy, 1, "cmd=put kvsname=kvs_7 key=bc-2 value=addr=1")) == \
        "cmd=put_result rc=0\n"
    assert reply_of(ask(proxy, 2, "cmd=get kvsname=kvs_7 key=bc-2")) == \
        "cmd=get_result rc=0 value=addr=1\n"


@pytest.mark.parametrize("line, msg", [
    ("cmd=put kvsname=kvs_7 key=PMI_process_mapping value=x", "keys_with_PMI_prefix_are_reserved"),
    ("cmd=put kvsname=other key=a value=x", "unknown_kvsname"),
    ("cmd=put kvsname=kvs_7 value=x", "key_missing"),
    ("cmd=put kvsname=kvs_7 key=a", "empty_value"),
    ("cmd=put kvsname=kvs_7 key=" + "k" * 65 + " value=x", "key_longer_than_64"),
    ("cmd=put kvsname=kvs_7 key=a value=" + "v" * 1025, "value_longer_than_1024"),
])
def test_a_bad_put_is_refused_with_rc_1_and_the_connection_stays_usable(line, msg):
    proxy = make_proxy()
    started(proxy, 1, 2)
    assert reply_of(ask(proxy, 1, line)) == f"cmd=put_result rc=1 msg={msg}\n"
    assert "rc=0" in reply_of(ask(proxy, 1, "cmd=get_appnum"))


@pytest.mark.parametrize("line, expected", [
    ("cmd=spawn nprocs=2 execname=a.out", ("cmd=spawn_result rc=-1 "
      "msg=dtrain_does_not_support_MPI_Comm_spawn\n")),
    ("cmd=publish_name service=s port=p", ("cmd=publish_result rc=-1 "
      "msg=dtrain_does_not_support_MPI_Publish_name\n")),
    ("cmd=unpublish_name service=s", ("cmd=unpublish_result rc=-1 "
      "msg=dtrain_does_not_support_MPI_Unpublish_name\n")),
    ("cmd=lookup_name service=s", ("cmd=lookup_result rc=-1 "
      "msg=dtrain_does_not_support_MPI_Lookup_name\n")),
])
def test_spawn_and_name_service_are_refused_clearly_and_the_head_is_told(line, expected):
    proxy = make_proxy()
    started(proxy, 1, 2)
    reply, notice = ask(proxy, 1, line)
    assert reply == Reply(1, expected.encode())
    feature = expected.split("support_")[1].strip()
    assert notice == Send({"op": "unsupported", "rank": 2, "feature": feature})


def test_a_multiline_spawn_block_is_swallowed_and_refused_once():
    proxy = make_proxy()
    started(proxy, 1, 2)
    block = ["mcmd=spawn", "nprocs=1", "execname=a b", "totspawns=2", "spawnssofar=1",
             "argcnt=0", "preput_num=0", "info_num=0", "endcmd",
             "mcmd=spawn", "nprocs=1", "execname=c", "totspawns=2", "spawnssofar=2",
             "argcnt=0", "info_num=0"]
    assert proxy.feed(1, "\n".join(block).encode() + b"\n") == []
    reply, notice = ask(proxy, 1, "endcmd")
    assert "spawn_result rc=-1" in reply.data.decode()
    assert notice.msg == {"op": "unsupported", "rank": 2, "feature": "MPI_Comm_spawn"}
    assert "rc=0" in reply_of(ask(proxy, 1, "cmd=get_appnum"))


def test_a_spawn_block_without_totspawns_closes_the_connection():
    proxy = make_proxy()
    started(proxy, 1, 2)
    why = closed_with_failure(proxy.feed(1, b"mcmd=spawn\nnprocs=1\nendcmd\n"), 1, 2)
    assert why == "broke the PMI protocol: spawn block without totspawns"


def test_a_pmi_2_init_is_refused_so_the_client_fails_cleanly():
    proxy = make_proxy()
    proxy.open(1, 2)
    assert "rc=-1" in reply_of(ask(proxy, 1, "cmd=init pmi_version=2 pmi_subversion=0"))


# ----- barrier and the head ----------------------------------------------------------------

def test_the_barrier_goes_upstream_once_with_this_hosts_puts():
    proxy = make_proxy()
    started(proxy, 1, 2)
    started(proxy, 2, 3)
    ask(proxy, 1, "cmd=put kvsname=kvs_7 key=a value=1")
    ask(proxy, 2, "cmd=put kvsname=kvs_7 key=b value=2")
    assert ask(proxy, 1, "cmd=barrier_in") == []
    assert ask(proxy, 2, "cmd=barrier_in") == [
        Send({"op": "barrier_in", "puts": {"a": "1", "b": "2"}})]


def test_barrier_out_releases_every_local_rank_and_fills_the_cache():
    proxy = make_proxy()
    started(proxy, 1, 2)
    started(proxy, 2, 3)
    ask(proxy, 1, "cmd=barrier_in")
    ask(proxy, 2, "cmd=barrier_in")
    out = proxy.upstream({"op": "barrier_out", "kv": {"remote": "r0"}})
    assert out == [Reply(1, b"cmd=barrier_out rc=0\n"), Reply(2, b"cmd=barrier_out rc=0\n")]
    assert reply_of(ask(proxy, 1, "cmd=get kvsname=kvs_7 key=remote")) == \
        "cmd=get_result rc=0 value=r0\n"


def test_the_next_barrier_carries_only_the_puts_made_since_the_last_one():
    proxy = make_proxy(ranks=[0])
    started(proxy, 1, 0)
    ask(proxy, 1, "cmd=put kvsname=kvs_7 key=a value=1")
    ask(proxy, 1, "cmd=barrier_in")
    proxy.upstream({"op": "barrier_out", "kv": {"a": "1"}})
    ask(proxy, 1, "cmd=put kvsname=kvs_7 key=b value=2")
    assert ask(proxy, 1, "cmd=barrier_in") == [Send({"op": "barrier_in", "puts": {"b": "2"}})]


def test_a_get_of_an_unknown_key_asks_the_head_and_relays_its_answer():
    proxy = make_proxy()
    started(proxy, 1, 2)
    assert ask(proxy, 1, "cmd=get kvsname=kvs_7 key=x") == [
        Send({"op": "get", "key": "x", "req": 1})]
    out = proxy.upstream({"op": "get_result", "req": 1, "found": True, "value": "v"})
    assert out == [Reply(1, b"cmd=get_result rc=0 value=v\n")]


def test_a_key_the_head_does_not_have_is_answered_rc_1():
    proxy = make_proxy()
    started(proxy, 1, 2)
    ask(proxy, 1, "cmd=get kvsname=kvs_7 key=x")
    out = proxy.upstream({"op": "get_result", "req": 1, "found": False, "value": ""})
    assert out == [Reply(1, b"cmd=get_result rc=1 msg=key_not_found\n")]


def test_a_get_result_for_a_connection_gone_meanwhile_is_dropped():
    proxy = make_proxy()
    started(proxy, 1, 2)
    ask(proxy, 1, "cmd=get kvsname=kvs_7 key=x")
    proxy.closed(1)
    assert proxy.upstream({"op": "get_result", "req": 1, "found": True, "value": "v"}) == []


@pytest.mark.parametrize("msg, why", [
    ({"op": "hello"}, "unknown op"),
    ({"op": "barrier_out", "kv": {}}, "before every local rank entered"),
    ({"op": "barrier_out"}, "without a kv object"),
    ({"op": "get_result", "req": 99, "found": False}, "unknown request 99"),
])
def test_a_malformed_head_message_is_a_dtrain_bug_reported_as_such(msg, why):
    with pytest.raises(PmiError, match=why):
        make_proxy().upstream(msg)


# ----- abort and failures ------------------------------------------------------------------

def test_abort_reports_rank_code_and_message_and_tells_the_head():
    proxy = make_proxy()
    started(proxy, 1, 3)
    assert ask(proxy, 1, "cmd=abort exitcode=42 message=out of memory") == [
        Abort(3, 42, "out of memory"),
        Send({"op": "abort", "rank": 3, "code": 42, "message": "out of memory"})]


def test_after_abort_the_rank_is_ignored_and_its_close_is_not_a_second_failure():
    proxy = make_proxy()
    started(proxy, 1, 3)
    ask(proxy, 1, "cmd=abort exitcode=42 message=abort")
    assert ask(proxy, 1, "cmd=barrier_in") == []
    assert proxy.closed(1) == []


def test_abort_accepts_flux_spelling_and_a_missing_code():
    proxy = make_proxy()
    proxy.open(1, 2)
    assert ask(proxy, 1, "cmd=abort exit_code=7 error_msg=bad")[0] == Abort(2, 7, "bad")
    proxy.open(2, 3)
    assert ask(proxy, 2, "cmd=abort")[0] == Abort(3, 1, "")


def test_closing_before_finalize_fails_the_rank():
    proxy = make_proxy()
    started(proxy, 1, 2)
    assert proxy.closed(1) == [RankFailed(2, "closed its PMI connection before finalize")]


def test_closing_after_finalize_is_a_normal_exit():
    proxy = make_proxy()
    started(proxy, 1, 2)
    ask(proxy, 1, "cmd=finalize")
    assert proxy.closed(1) == []


def test_a_program_that_never_speaks_pmi_may_close_its_connection():
    proxy = make_proxy()
    proxy.open(1, 2)
    assert proxy.closed(1) == []


def test_a_garbage_line_closes_the_connection_and_fails_its_rank():
    proxy = make_proxy()
    started(proxy, 1, 2)
    assert "does not start with cmd=" in closed_with_failure(ask(proxy, 1, "hello"), 1, 2)
    assert proxy.feed(1, b"cmd=get_appnum\n") == []
    assert proxy.closed(1) == []


def test_an_oversized_line_without_newline_is_cut_off_after_the_lines_before_it():
    proxy = make_proxy()
    started(proxy, 1, 2)
    actions = proxy.feed(1, b"cmd=get_appnum\ncmd=put value=" + b"x" * 4100)
    assert isinstance(actions[0], Reply)
    assert "exceeds the 4096-byte limit" in closed_with_failure(actions[1:], 1, 2)


def test_a_command_before_init_closes_the_connection():
    proxy = make_proxy()
    proxy.open(1, 2)
    assert "before init" in closed_with_failure(ask(proxy, 1, "cmd=get_maxes"), 1, 2)


def test_init_twice_closes_the_connection():
    proxy = make_proxy()
    started(proxy, 1, 2)
    assert "init twice" in closed_with_failure(ask(proxy, 1, "cmd=init pmi_version=1"), 1, 2)


def test_a_second_request_while_one_is_pending_closes_the_connection():
    proxy = make_proxy()
    started(proxy, 1, 2)
    ask(proxy, 1, "cmd=barrier_in")
    why = closed_with_failure(ask(proxy, 1, "cmd=get_appnum"), 1, 2)
    assert "while its barrier was pending" in why


def test_an_unknown_command_closes_the_connection():
    proxy = make_proxy()
    started(proxy, 1, 2)
    assert "unknown command frobnicate" in closed_with_failure(
        ask(proxy, 1, "cmd=frobnicate"), 1, 2)


def test_a_command_after_finalize_closes_without_failing_the_rank():
    proxy = make_proxy()
    started(proxy, 1, 2)
    ask(proxy, 1, "cmd=finalize")
    assert ask(proxy, 1, "cmd=get_appnum") == [Close(1, "sent get_appnum after finalize")]


def test_a_second_connection_for_a_connected_rank_is_refused_without_harm():
    proxy = make_proxy()
    started(proxy, 1, 2)
    assert proxy.open(2, 2) == [Close(2, "rank 2 already has a PMI connection")]
    assert "rc=0" in reply_of(ask(proxy, 1, "cmd=get_appnum"))


def test_a_connection_for_a_rank_of_another_host_is_refused():
    assert make_proxy().open(1, 0) == [Close(1, "rank 0 does not run on this host")]


def test_initack_on_an_inherited_fd_connection_is_a_protocol_error():
    proxy = make_proxy()
    proxy.open(1, 2)
    closed_with_failure(ask(proxy, 1, "cmd=initack pmiid=5"), 1, 2)


# ----- PMI_PORT mode ------------------------------------------------------------------------

def test_initack_binds_the_rank_and_answers_with_the_three_set_lines():
    proxy = make_proxy(tokens={"918273": 3})
    assert proxy.open(1, None) == []
    assert reply_of(ask(proxy, 1, "cmd=initack pmiid=918273")) == (
        "cmd=initack rc=0\ncmd=set size=4\ncmd=set rank=3\ncmd=set debug=0\n")
    assert "rc=0" in reply_of(ask(proxy, 1, "cmd=init pmi_version=1 pmi_subversion=1"))
    assert proxy.closed(1) == [RankFailed(3, "closed its PMI connection before finalize")]


def test_a_forged_pmi_id_is_closed_and_the_real_rank_still_connects():
    proxy = make_proxy(tokens={"918273": 3})
    proxy.open(9, None)
    assert ask(proxy, 9, "cmd=initack pmiid=12345") == [Close(9, "unknown or already used PMI_ID")]
    proxy.open(1, None)
    assert "cmd=set rank=3" in reply_of(ask(proxy, 1, "cmd=initack pmiid=918273"))


def test_a_pmi_id_works_only_once():
    proxy = make_proxy(tokens={"918273": 3})
    proxy.open(1, None)
    ask(proxy, 1, "cmd=initack pmiid=918273")
    proxy.open(2, None)
    assert ask(proxy, 2, "cmd=initack pmiid=918273") == [
        Close(2, "unknown or already used PMI_ID")]
    assert "rc=0" in reply_of(ask(proxy, 1, "cmd=init pmi_version=1"))


def test_anything_but_initack_on_an_unidentified_connection_closes_it_alone():
    proxy = make_proxy(tokens={"918273": 3})
    proxy.open(1, None)
    assert ask(proxy, 1, "cmd=init pmi_version=1") == [
        Close(1, "sent init before initack (PMI_PORT mode)")]
    proxy.open(2, None)
    assert [type(a) for a in proxy.feed(2, b"\x16\x03\x01garbage\n")] == [Close]


def test_shm_segment_prefixes_follow_mpichs_hash_of_the_kvsname():
    # Observed with the mpich 5.0.2 wheel: kvsname "kvs_test_1" -> /dev/shm/mpich_shm_7bd7e2ae_0
    assert shm_segment_prefixes("kvs_test_1") == ("mpich_shm_7bd7e2ae_", "mpich_vci_7bd7e2ae_")


# ----- cards left above by the fence ---------------------------------------------------------

def _fenced(proxy: PmiProxy, held: int) -> None:
    """Ranks 2 and 3 (conns 1, 2) through a fence whose cards (``held`` bytes) stayed above."""
    for conn, rank in ((1, 2), (2, 3)):
        started(proxy, conn, rank)
    assert ask(proxy, 1, "cmd=barrier_in") == []
    assert isinstance(ask(proxy, 2, "cmd=barrier_in")[0], Send)
    actions = proxy.upstream({"op": "barrier_out", "kv": {}, "held": held})
    assert [a.data for a in actions] == [b"cmd=barrier_out rc=0\n"] * 2


def test_gets_go_up_one_by_one_while_they_cost_less_than_fetching_every_card():
    proxy = make_proxy()
    _fenced(proxy, held=2 * GET_COST_BYTES)
    sent = []
    for conn, key in ((1, "bc-0"), (2, "bc-1")):
        (send,) = ask(proxy, conn, f"cmd=get kvsname=kvs_7 key={key}")
        sent.append(send.msg)
        assert reply_of(proxy.upstream({"op": "get_result", "req": send.msg["req"],
                                        "found": True, "value": key.upper()})) == \
            f"cmd=get_result rc=0 value={key.upper()}\n"
    assert [m["op"] for m in sent] == ["get", "get"]
    # Two gets cost as much as every card: the next miss fetches them all, the one after
    # waits for the same answer, and both are answered from it (a key never put: not found).
    (fetch,) = ask(proxy, 1, "cmd=get kvsname=kvs_7 key=bc-5")
    assert fetch.msg == {"op": "fetch"}
    assert ask(proxy, 2, "cmd=get kvsname=kvs_7 key=nope") == []
    replies = proxy.upstream({"op": "cards", "kv": {"bc-5": "five", "bc-0": "BC-0"}})
    assert [(r.conn, r.data) for r in replies] == [
        (1, b"cmd=get_result rc=0 value=five\n"), (2, b"cmd=get_result rc=1 msg=key_not_found\n")]
    # Fetched once per fence: a later miss goes up on its own.
    assert ask(proxy, 1, "cmd=get kvsname=kvs_7 key=bc-6")[0].msg["op"] == "get"


def test_a_rank_that_reads_card_after_card_has_its_host_fetch_them_all_long_before_the_bytes_say():
    # MPICH's default exchange: one rank reads every card, each get waiting for the one
    # before. Bytes alone would allow 1,000 gets here; that rank's gets are the cost.
    proxy = make_proxy()
    _fenced(proxy, held=1000 * GET_COST_BYTES)
    for i in range(DENSE_GETS):
        (send,) = ask(proxy, 1, f"cmd=get kvsname=kvs_7 key=bc-{i}")
        assert send.msg["op"] == "get"
        proxy.upstream({"op": "get_result", "req": send.msg["req"], "found": True, "value": "v"})
    (fetch,) = ask(proxy, 1, f"cmd=get kvsname=kvs_7 key=bc-{DENSE_GETS}")
    assert fetch.msg["op"] == "fetch"


def test_ranks_that_each_read_a_few_cards_keep_getting_them_one_by_one():
    proxy = make_proxy()  # two ranks: together more than one rank's DENSE_GETS, each fewer
    _fenced(proxy, held=1000 * GET_COST_BYTES)
    for i in range(DENSE_GETS - 1):
        for conn in (1, 2):
            (send,) = ask(proxy, conn, f"cmd=get kvsname=kvs_7 key=bc-{conn}-{i}")
            assert send.msg["op"] == "get"
            proxy.upstream({"op": "get_result", "req": send.msg["req"], "found": True,
                            "value": "v"})


def test_a_miss_on_an_mpich_allgather_key_fetches_every_card_at_once():
    # MPICH's address exchange: after the fence every host reads every host's card, so the
    # first key it misses already says so; the other rank's miss waits for the same answer.
    proxy = make_proxy()
    _fenced(proxy, held=1000 * GET_COST_BYTES)
    (fetch,) = ask(proxy, 1, "cmd=get kvsname=kvs_7 key=-allgather-1-0")
    assert fetch.msg == {"op": "fetch"}
    assert ask(proxy, 2, "cmd=get kvsname=kvs_7 key=-allgather-shm-2-1-seg-3/9") == []
    replies = proxy.upstream({"op": "cards", "kv": {
        "-allgather-1-0": "segments=9", "-allgather-shm-2-1-seg-3/9": "abc"}})
    assert [(r.conn, r.data) for r in replies] == [
        (1, b"cmd=get_result rc=0 value=segments=9\n"), (2, b"cmd=get_result rc=0 value=abc\n")]


@pytest.mark.parametrize("key", ["-bcast-1-0", "-allgather-group-1-3", "-allgather-1-x",
                                 "app-allgather-1-0", "-allgather-1-0-seg-1"])
def test_keys_that_are_not_an_mpich_allgathers_go_up_one_by_one(key):
    # A broadcast is one card; a group's all-gather reads only the group's; the rest only
    # look like MPICH's names.
    proxy = make_proxy()
    _fenced(proxy, held=1000 * GET_COST_BYTES)
    (send,) = ask(proxy, 1, f"cmd=get kvsname=kvs_7 key={key}")
    assert send.msg == {"op": "get", "key": key, "req": send.msg["req"]}


def test_an_allgather_key_missed_after_a_fence_that_pushed_its_cards_is_asked_for_alone():
    # Every card came with the fence: a key not among them is not committed, nothing to fetch.
    proxy = make_proxy()
    _fenced(proxy, held=0)
    (send,) = ask(proxy, 1, "cmd=get kvsname=kvs_7 key=-allgather-1-9")
    assert send.msg["op"] == "get"


def test_the_allgather_rule_names_the_keys_the_installed_mpich_formats():
    # The format strings in this machine's libmpi (MPICH's mpir_pmi.c), formatted as its
    # sprintf does: an all-gather's key, its shared-memory variant and their segments' names
    # match; its broadcast's and its group all-gather's do not.
    lib = _libmpi()
    seg = b"%s-seg-%d/%d"
    cases = [(b"-allgather-%d-%d", (1, 8), True), (b"-allgather-shm-%d-%d", (3, 17), True),
             (seg, (b"-allgather-1-8", 9, 9), True), (seg, (b"-allgather-shm-2-0", 1, 4), True),
             (b"-bcast-%d-%d", (1, 0), False), (b"-allgather-group-%d", (2,), False)]
    for fmt, args, allgather in cases:
        assert b"\0" + fmt + b"\0" in lib, fmt
        key = (fmt % args).decode()  # C's printf format: Python's bytes % reads it alike
        assert is_allgather_key(key) == allgather, key


def _libmpi() -> bytes:
    """The MPICH wheel's libmpi beside this interpreter's environment (`make install`)."""
    found = sorted(Path(sys.prefix, "lib").glob("libmpi.so.*"))
    assert found, f"no libmpi.so.* under {sys.prefix}/lib; run `make install`"
    return found[0].read_bytes()


def test_cards_for_a_fetch_never_asked_are_a_relay_error():
    proxy = make_proxy()
    _fenced(proxy, held=10)
    with pytest.raises(PmiError, match="cards without a fetch under way"):
        proxy.upstream({"op": "cards", "kv": {}})
