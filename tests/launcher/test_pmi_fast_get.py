"""The proxy's fast path for the gets of a wire-up: the same answers and rules as the generic
path, line for line (`launcher.pmi.proxy.PmiProxy._cached_get`)."""

from __future__ import annotations

import pytest

from launcher.errors import PmiError
from launcher.pmi import proxy as proxy_module
from launcher.pmi.actions import Close, RankFailed, Reply, Send
from launcher.pmi.codec import format_reply, found_reply, get_line_pattern
from launcher.pmi.proxy import PmiProxy

KVS = "kvs_7"
CARDS = {"bc-0": "addr=1", "bc-1": "with space and back\\slash", "-seg-1/2": "x" * 1024,
         "bc-3": "é=ü"}


def fenced(kvsname: str = KVS) -> PmiProxy:
    """Ranks 2 and 3 (connections 1 and 2) through init and one fence that brought ``CARDS``."""
    proxy = PmiProxy(ranks=(2, 3), world_size=4, kvsname=kvsname,
                     process_mapping="(vector,(0,2,2))")
    for conn, rank in ((1, 2), (2, 3)):
        assert proxy.open(conn, rank) == []
        proxy.feed(conn, b"cmd=init pmi_version=1 pmi_subversion=1\n")
        proxy.feed(conn, b"cmd=barrier_in\n")
    proxy.upstream({"op": "barrier_out", "kv": dict(CARDS)})
    return proxy


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch) -> tuple[PmiProxy, PmiProxy]:
    """(with the fast path, without it: every line parsed, checked and formatted generically),
    in the same state."""
    fast = fenced()
    monkeypatch.setattr(proxy_module, "get_line_pattern", lambda kvsname, keylen_max: None)
    return fast, fenced()


LINES = [
    b"cmd=get kvsname=kvs_7 key=bc-0\n",                  # fast
    b"cmd=get kvsname=kvs_7 key=bc-1\n",                  # fast, the value escaped
    b"cmd=get kvsname=kvs_7 key=-seg-1/2\n",              # fast, the longest value
    b"cmd=get kvsname=kvs_7 key=bc-3\n",                  # fast, not ASCII
    b"cmd=get kvsname=kvs_7 key=PMI_process_mapping\n",  # a job attribute: generic
    b"cmd=get kvsname=kvs_7 key=PMI_hwloc_xmlfile\n",    # absent attribute: generic
    b"cmd=get kvsname=kvs_7 key=nobody\n",                # not here: asked above
    b"cmd=get kvsname=kvs_8 key=bc-0\n",                  # another job's kvsname
    b"cmd=get kvsname=kvs_7 key=" + b"k" * 65 + b"\n",    # key over 64 characters
    b"cmd=get kvsname=kvs_7 key=bc-0 extra=1\n",          # more attributes
    b"cmd=get  kvsname=kvs_7 key=bc-0\n",                 # two spaces
    b"cmd=get kvsname=kvs_7 key=bc-0\ncmd=get kvsname=kvs_7 key=bc-3\n",  # two in one read
    b"cmd=get kvsname=kvs_7 key=bc\x01\n",                # a control character
]


@pytest.mark.parametrize("line", LINES)
def test_every_get_is_answered_as_the_generic_path_answers_it(pair, line):
    fast, generic = pair
    assert fast.feed(1, line) == generic.feed(1, line)
    # and the connection is left in the same state: the next get is answered alike
    follow = b"cmd=get kvsname=kvs_7 key=bc-1\n"
    assert fast.feed(2, follow) == generic.feed(2, follow)


def test_a_cached_card_is_its_value_in_one_reply():
    proxy = fenced()
    assert proxy.feed(1, b"cmd=get kvsname=kvs_7 key=bc-1\n") == [
        Reply(1, format_reply("get_result", rc=0, value=CARDS["bc-1"]))]


@pytest.mark.parametrize("value", ["plain", "a b", "a\\b", "é", "x=y=z", " lead", "v" * 1024])
def test_the_fast_reply_is_byte_for_byte_the_generic_reply(value):
    assert found_reply(value) == format_reply("get_result", rc=0, value=value)


@pytest.mark.parametrize("kvsname", ["", "a b", "a\\b", "kvs\x01", "é", "k" * 3000])
def test_a_kvsname_that_the_wire_would_escape_has_no_fast_path(kvsname):
    assert get_line_pattern(kvsname, 64) is None


def test_a_job_whose_kvsname_has_no_fast_path_still_serves_every_get():
    proxy = fenced("kvs 7")
    assert proxy.feed(1, b"cmd=get kvsname=kvs\\ 7 key=bc-0\n") == [
        Reply(1, b"cmd=get_result rc=0 value=addr=1\n")]


def test_a_get_split_across_reads_is_answered_once_whole():
    proxy = fenced()
    assert proxy.feed(1, b"cmd=get kvsname=kvs_7 ") == []
    assert proxy.feed(1, b"key=bc-0\n") == [Reply(1, b"cmd=get_result rc=0 value=addr=1\n")]


def test_a_get_that_completes_a_buffered_line_is_not_served_alone(pair):
    fast, generic = pair
    for proxy in (fast, generic):
        assert proxy.feed(1, b"cmd=get kvsname=kvs_7 key=bc-") == []
    # the buffered bytes and these make one line, whose key is not bc-0
    line = b"cmd=get kvsname=kvs_7 key=bc-0\n"
    out = fast.feed(1, line)
    assert out == generic.feed(1, line)
    assert Reply(1, b"cmd=get_result rc=0 value=addr=1\n") not in out


def test_a_get_while_a_get_is_pending_above_breaks_the_rank_as_before():
    proxy = fenced()
    assert proxy.feed(1, b"cmd=get kvsname=kvs_7 key=nobody\n") == [
        Send({"op": "get", "key": "nobody", "req": 1})]
    out = proxy.feed(1, b"cmd=get kvsname=kvs_7 key=bc-0\n")
    assert [type(a) for a in out] == [Close, RankFailed]
    assert "one request at a time" in out[1].reason


def test_a_get_after_finalize_closes_the_connection_without_a_reply():
    proxy = fenced()
    proxy.feed(1, b"cmd=finalize\n")
    out = proxy.feed(1, b"cmd=get kvsname=kvs_7 key=bc-0\n")
    assert out == [Close(1, "sent get after finalize")]


def test_a_get_before_init_is_refused_as_before():
    proxy = PmiProxy(ranks=(2,), world_size=4, kvsname=KVS, process_mapping="")
    proxy.open(1, 2)
    out = proxy.feed(1, b"cmd=get kvsname=kvs_7 key=bc-0\n")
    assert [type(a) for a in out] == [Close, RankFailed] and "before init" in out[1].reason


def test_an_aborted_rank_gets_no_answer():
    proxy = fenced()
    proxy.feed(1, b"cmd=abort exitcode=3\n")
    assert proxy.feed(1, b"cmd=get kvsname=kvs_7 key=bc-0\n") == []


def test_a_card_put_again_in_a_later_epoch_is_served_new():
    proxy = fenced()
    proxy.feed(1, b"cmd=barrier_in\n")
    proxy.feed(2, b"cmd=barrier_in\n")
    proxy.upstream({"op": "barrier_out", "kv": {"bc-0": "addr=2"}})
    assert proxy.feed(1, b"cmd=get kvsname=kvs_7 key=bc-0\n") == [
        Reply(1, b"cmd=get_result rc=0 value=addr=2\n")]


def test_a_get_line_inside_a_spawn_block_is_part_of_the_block(pair):
    for proxy in pair:
        assert proxy.feed(1, b"mcmd=spawn\n") == []
        assert proxy.feed(1, b"cmd=get kvsname=kvs_7 key=bc-0\n") == []
        out = proxy.feed(1, b"totspawns=1\nendcmd\n")
        assert [type(a) for a in out] == [Reply, Send] and b"rc=-1" in out[0].data


def test_cards_pushed_ahead_of_the_release_release_nobody_and_are_served_after_it():
    proxy = PmiProxy(ranks=(2, 3), world_size=4, kvsname=KVS, process_mapping="")
    for conn, rank in ((1, 2), (2, 3)):
        proxy.open(conn, rank)
        proxy.feed(conn, b"cmd=init pmi_version=1 pmi_subversion=1\n")
        proxy.feed(conn, b"cmd=barrier_in\n")
    assert proxy.upstream({"op": "push", "kv": dict(CARDS)}) == []
    assert proxy.epoch == 0 and proxy.fenced == frozenset({2, 3})  # still in the barrier
    assert proxy.upstream({"op": "barrier_out", "kv": {}}) == [
        Reply(1, b"cmd=barrier_out rc=0\n"), Reply(2, b"cmd=barrier_out rc=0\n")]
    assert proxy.feed(2, b"cmd=get kvsname=kvs_7 key=bc-0\n") == [
        Reply(2, b"cmd=get_result rc=0 value=addr=1\n")]


def test_a_push_without_cards_is_a_relay_error():
    with pytest.raises(PmiError, match="push without a kv object"):
        fenced().upstream({"op": "push"})


@pytest.mark.parametrize("line", LINES)
def test_the_adapters_fast_get_is_the_reply_feed_gives_or_nothing_where_feed_does_more(line):
    fast, generic = fenced(), fenced()
    reply = fast.fast_get(1, line)
    if reply is None:  # the adapter hands it to feed, which must then do the same
        assert fast.feed(1, line) == generic.feed(1, line)
    else:
        assert generic.feed(1, line) == [Reply(1, reply)]
    follow = b"cmd=get kvsname=kvs_7 key=bc-1\n"
    assert fast.feed(1, follow) == generic.feed(1, follow)


def test_the_fast_get_answers_nothing_on_an_unknown_or_uninitialised_connection():
    proxy = fenced()
    assert proxy.fast_get(9, b"cmd=get kvsname=kvs_7 key=bc-0\n") is None
    proxy.open(3, None)
    assert proxy.fast_get(3, b"cmd=get kvsname=kvs_7 key=bc-0\n") is None
