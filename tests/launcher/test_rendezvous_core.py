"""Rendezvous mode's pure cores: the handshake, the sealed channel, the roster, the token file.
Both sides of the handshake run against each other in memory; nothing here opens a socket."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from launcher import wire
from launcher.errors import UsageError
from launcher.rendezvous import tokens
from launcher.rendezvous.channel import RECORD_MAX, ChannelError
from launcher.rendezvous.handshake import AgentSide, AuthError, HandshakeError, HeadSide
from launcher.rendezvous.options import parse_endpoint, read_token
from launcher.rendezvous.roster import Arrival, Roster, Unusable, read_join

TOKEN = tokens.new().encode()
OTHER = tokens.new().encode()


def _joined(agent_token: bytes = TOKEN, head_token: bytes = TOKEN):
    agent, head = AgentSide(agent_token), HeadSide(head_token)
    reply, to_agent = head.verify(agent.prove(head.challenge(agent.hello())))
    return agent.check(reply), to_agent


def test_both_sides_with_one_token_meet_and_their_channel_carries_bytes_both_ways() -> None:
    to_head, to_agent = _joined()
    assert to_agent.open(to_head.seal(b"JOIN")) == b"JOIN"
    assert to_head.open(to_agent.seal(b"SPEC" * 1000)) == b"SPEC" * 1000


def test_the_head_answers_a_stranger_with_nothing_keyed_by_its_token() -> None:
    """What anyone who reaches the port gets back is the same whatever the head's token: there
    is nothing to take home and guess the token against."""
    hello = AgentSide(OTHER).hello()
    nonce = os.urandom(32)
    assert HeadSide(TOKEN, nonce).challenge(hello) == HeadSide(OTHER, nonce).challenge(hello)
    assert HeadSide(TOKEN, nonce).challenge(hello) == {"nonce": nonce.hex()}


def test_a_head_refuses_an_agent_with_another_token_before_proving_anything() -> None:
    agent, head = AgentSide(OTHER), HeadSide(TOKEN)
    with pytest.raises(AuthError, match="agent's proof does not match"):
        head.verify(agent.prove(head.challenge(agent.hello())))


def test_an_agent_refuses_a_forged_head_proof() -> None:
    agent, head = AgentSide(TOKEN), HeadSide(TOKEN)
    agent.prove(head.challenge(agent.hello()))
    with pytest.raises(AuthError, match="head's proof does not match"):
        agent.check({"proof": "00" * 32})


def test_the_token_never_travels_and_a_recorded_proof_does_not_pass_a_new_nonce() -> None:
    agent, head = AgentSide(TOKEN), HeadSide(TOKEN)
    hello = agent.hello()
    challenge = head.challenge(hello)
    proof = agent.prove(challenge)
    reply, _ = head.verify(proof)
    assert all(TOKEN.hex() not in str(m) and TOKEN.decode() not in str(m)
               for m in (hello, challenge, proof, reply))
    replayed = HeadSide(TOKEN)
    replayed.challenge(hello)  # the same agent nonce, a new head nonce
    with pytest.raises(AuthError):
        replayed.verify(proof)


def test_an_agent_proof_does_not_pass_as_a_head_proof() -> None:
    agent, head = AgentSide(TOKEN), HeadSide(TOKEN)
    proof = agent.prove(head.challenge(agent.hello()))
    with pytest.raises(AuthError):
        agent.check(proof)  # reflected back: the roles differ


@pytest.mark.parametrize(("hello", "why"), [
    ({"nonce": "00" * 32}, "did not open with a dtrain rendezvous hello"),
    ({"rendezvous": 99, "nonce": "00" * 32}, "speaks rendezvous 99, the head 2"),
    ({"rendezvous": 2, "nonce": "zz"}, "nonce field is not 32 bytes"),
])
def test_a_hello_that_is_not_this_handshake_is_a_handshake_error(hello: dict[str, object],
                                                                 why: str) -> None:
    with pytest.raises(HandshakeError, match=why):
        HeadSide(TOKEN).challenge(hello)


def test_a_changed_or_replayed_record_breaks_the_channel() -> None:
    to_head, to_agent = _joined()
    record = bytearray(to_head.seal(b"SPEC"))
    record[-1] ^= 1
    with pytest.raises(ChannelError, match="does not open"):
        to_agent.open(bytes(record))
    to_head, to_agent = _joined()
    first = to_head.seal(b"one")
    to_agent.open(first)
    with pytest.raises(ChannelError):
        to_agent.open(first)  # the same record again: its number is past


def test_a_large_write_is_split_into_records_and_a_partial_record_waits() -> None:
    to_head, to_agent = _joined()
    data = os.urandom(RECORD_MAX + 10)
    sealed = to_head.seal(data)
    assert to_agent.open(sealed[:100]) == b""
    assert to_agent.open(sealed[100:]) == data


def test_nothing_in_clear_reaches_the_wire() -> None:
    to_head, _ = _joined()
    secret = b"WANDB_API_KEY=0123456789abcdef"
    assert secret not in to_head.seal(secret)


def _arrival(host: str, rank: int | None = None, address: str = "10.0.0.9") -> Arrival:
    return Arrival(host, address, rank, None)


def test_the_roster_orders_by_host_name_numbers_as_numbers_whatever_the_arrival_order() -> None:
    roster = Roster(4)
    for host in ("node10", "Node3", "node1", "node2"):
        assert roster.admit(_arrival(host)).admitted
    assert roster.complete
    assert [a.host for a in roster.start()] == ["node1", "node2", "Node3", "node10"]


def test_an_explicit_node_rank_takes_its_place_and_the_others_fill_by_name() -> None:
    roster = Roster(3)
    for arrival in (_arrival("b", 0), _arrival("c"), _arrival("a")):
        assert roster.admit(arrival).admitted
    assert [a.host for a in roster.start()] == ["b", "a", "c"]


@pytest.mark.parametrize(("second", "why"), [
    (_arrival("NODE1", address="10.0.0.7"), "from host node1 (10.0.0.9) already joined"),
    (_arrival("node2", 0), "node rank 0 is taken by node1 (10.0.0.9)"),
    (_arrival("node2", 4), "node rank 4 is outside 0..2 (--nnodes 3)"),
])
def test_a_duplicate_or_impossible_agent_is_refused_and_the_first_keeps_its_place(
        second: Arrival, why: str) -> None:
    roster = Roster(3)
    assert roster.admit(_arrival("node1", 0)).admitted
    admission = roster.admit(second)
    assert not admission.admitted
    assert why in admission.why
    assert [a.host for a in roster.arrivals] == ["node1"]


def test_include_and_exclude_turn_away_the_hosts_they_leave_out() -> None:
    included = Roster(2, include="node1@node2:0")
    assert included.admit(_arrival("node2")).admitted
    assert included.admit(_arrival("node9")).why == "--include does not name node9"
    excluded = Roster(2, exclude="node3@node4:1")
    assert excluded.admit(_arrival("node3")).why == "--exclude leaves node3 out"
    assert excluded.admit(_arrival("node4")).admitted  # only one of its slots is left out


def test_an_agent_that_leaves_before_the_start_frees_its_place() -> None:
    roster = Roster(2)
    roster.admit(_arrival("node1"))
    roster.leave("NODE1")
    assert roster.arrivals == [] and roster.missing("within 5s") == "0 of 2 agents joined within 5s"
    roster.admit(_arrival("node2"))
    assert roster.missing("within 5s") == "1 of 2 agents joined within 5s: node2 (10.0.0.9)"


def test_after_the_start_a_late_agent_is_refused_unless_a_seat_was_vacated() -> None:
    roster = Roster(2)
    roster.admit(_arrival("node1"))
    roster.admit(_arrival("node2"))
    roster.start()
    late = roster.admit(_arrival("node5"))
    assert "already started with 2 agents" in late.why
    roster.vacate(1)  # the restart hook: node2 was given up on
    assert "already has a seat" in roster.admit(_arrival("node1")).why
    replacement = roster.admit(_arrival("node5"))
    assert replacement.admitted and replacement.seat == 1
    assert [a.host for a in roster.seats] == ["node1", "node5"]
    assert not roster.admit(_arrival("node6")).admitted


def test_a_join_of_another_protocol_or_with_a_bad_host_name_is_unusable() -> None:
    good = {"protocol": wire.PROTOCOL_VERSION, "host": "node1", "node_rank": None, "gpus": 8}
    assert read_join(good, "10.0.0.2") == Arrival("node1", "10.0.0.2", None, 8)
    for change, why in (({"protocol": 1}, "speaks protocol 1"),
                        ({"host": "-oProxyCommand=x"}, "starts with '-'"),
                        ({"host": "localhost"}, "host name is localhost"),
                        ({"node_rank": "2"}, "node rank '2' is not a number")):
        with pytest.raises(Unusable, match=why):
            read_join({**good, **change}, "10.0.0.2")


def _token_file(tmp_path: Path, text: str, mode: int = 0o600) -> str:
    path = tmp_path / "token"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def test_a_generated_token_is_read_without_its_surrounding_whitespace(tmp_path: Path) -> None:
    assert read_token(_token_file(tmp_path, f"  {TOKEN.decode()}\n")) == TOKEN


def _changed(token: bytes, at: int) -> str:
    text = token.decode()
    return text[:at] + ("0" if text[at] != "0" else "1") + text[at + 1:]


@pytest.mark.parametrize(("text", "mode", "why"), [
    (TOKEN.decode(), 0o644, "open to other users.*mode 0644.*chmod 600"),
    ("short", 0o600, "not a token made by `dtrain token new`"),
    ("0123456789abcdef0123456789abcdef", 0o600, "not a token made by `dtrain token new`"),
    ("correct horse battery staple!!!!", 0o600, "not a token made by `dtrain token new`"),
    (_changed(TOKEN, 20), 0o600, "check digits do not match"),
    (TOKEN.decode()[:-1], 0o600, "not a token made"),
], ids=["readable by others", "short", "hex of 128 bits", "a passphrase", "a changed digit",
        "cut short"])  # TOKEN is new in every process: ids from it would differ between workers
def test_a_token_file_others_can_read_or_a_token_not_made_by_dtrain_is_refused_saying_how(
        tmp_path: Path, text: str, mode: int, why: str) -> None:
    with pytest.raises(UsageError, match=why) as refused:
        read_token(_token_file(tmp_path, text, mode))
    assert "dtrain token new > token" in str(refused.value) or "chmod 600" in str(refused.value)
    assert text not in str(refused.value)  # a secret, even a bad one, is never printed


def test_tokens_carry_256_random_bits_and_two_are_never_alike() -> None:
    made = {tokens.new() for _ in range(100)}
    assert len(made) == 100
    assert all(tokens.why_not(t) == "" and len(t) == len(tokens.PREFIX) + 64 + 9 for t in made)


def test_a_missing_token_file_is_one_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"cannot read the token file \[--token-file .*nope\]"):
        read_token(str(tmp_path / "nope"))


def test_the_head_address_is_host_and_port() -> None:
    assert parse_endpoint("head-0.rdzv.default.svc:29400", "--rendezvous") == (
        "head-0.rdzv.default.svc", 29400)
    assert parse_endpoint("[fd00::1]:29400", "--rendezvous") == ("fd00::1", 29400)
    with pytest.raises(UsageError, match="'head' is not HOST:PORT"):
        parse_endpoint("head", "--rendezvous")
