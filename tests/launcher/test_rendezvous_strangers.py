"""What the rendezvous port makes of strangers, in memory: handshake frames bounded in size and
nesting before they are parsed, network text escaped before it is printed, and the few
rate-limited lines about connections that proved no token."""

from __future__ import annotations

import pytest

from launcher import wire
from launcher.rendezvous import clear
from launcher.rendezvous.handshake import HandshakeError
from launcher.rendezvous.strangers import Strangers


def test_a_4kb_hello_of_nested_arrays_is_refused_before_json_parses_it() -> None:
    nested = b"[" * 2000 + b"]" * 2000
    frame, used = clear.split(wire.encode(wire.Kind.AUTH, nested))
    assert frame is not None and used == 5 + len(nested)
    with pytest.raises(HandshakeError, match="nests 5 levels deep"):
        clear.body(frame)


def test_brackets_inside_strings_do_not_count_as_nesting_and_a_flat_hello_parses() -> None:
    body = {"rendezvous": 2, "nonce": "[[[[[[{{{{{{", "note": "\\\"[[[[[["}
    frame, _ = clear.split(wire.encode_json(wire.Kind.AUTH, body))
    assert frame is not None and clear.body(frame) == body


@pytest.mark.parametrize(("data", "why"), [
    ((5000).to_bytes(4, "big") + b"\x14", "5000-byte frame"),  # refused from its header alone
    ((0).to_bytes(4, "big") + b"\x14", "0-byte frame"),
    ((3).to_bytes(4, "big") + b"\xfe{}", "unknown frame kind 254"),
])
def test_an_oversized_empty_or_unknown_frame_is_refused(data: bytes, why: str) -> None:
    with pytest.raises(HandshakeError, match=why):
        clear.split(data)


@pytest.mark.parametrize("payload", [b"\xff\xfe", b"[1, 2]", b"{\"a\": ", b"nul"])
def test_a_frame_that_is_not_a_json_object_is_a_handshake_error(payload: bytes) -> None:
    with pytest.raises(HandshakeError):
        clear.body(wire.Frame(wire.Kind.AUTH, payload))


def test_a_partial_frame_waits_for_the_rest() -> None:
    data = wire.encode_json(wire.Kind.AUTH, {"nonce": "00"})
    assert clear.split(data[:7]) == (None, 0)


def test_text_from_the_network_is_printed_with_its_control_characters_escaped() -> None:
    said = "wrong token\x1b[2J\x1b[31m\rdtrain: all good\u202egnp.exe\x00"
    shown = clear.shown(said)
    assert shown == "wrong token\\x1b[2J\\x1b[31m\\rdtrain: all good\\u202egnp.exe\\x00"
    assert all(ch.isprintable() for ch in shown)
    assert clear.shown("x" * 5000) == "x" * clear.TEXT_MAX + "..."


def test_one_address_gets_one_line_then_one_per_interval_with_the_count_since() -> None:
    strangers = Strangers(interval=60.0, lines=10)
    first = strangers.note("10.0.0.5", "wrong proof", 0.0, agent=True)
    assert first == "ignored a connection from 10.0.0.5: wrong proof; the rendezvous goes on"
    assert [strangers.note("10.0.0.5", "wrong proof", t, agent=True) for t in range(1, 60)] == [
        None] * 59
    assert strangers.note("10.0.0.5", "wrong proof", 61.0, agent=True) == (
        "ignored 60 more connections (61 in all) from 10.0.0.5: wrong proof; the rendezvous "
        "goes on")
    assert strangers.agents() == "10.0.0.5 (61x)"


def test_many_addresses_get_a_bounded_number_of_lines_and_the_rest_are_counted() -> None:
    strangers = Strangers(interval=60.0, lines=10)
    lines = [strangers.note(f"10.0.{i // 250}.{i % 250}", "idle", i / 1000) for i in range(1000)]
    shown = [line for line in lines if line]
    assert len(shown) == 11 and "counted, not shown" in shown[-1]
    assert strangers.agents() == ""  # idle connections are no agents that failed the token
    assert strangers.note("10.9.9.9", "idle", 61.0) is not None  # the next interval


def test_the_timeout_names_the_addresses_where_agents_failed_the_token_most_first() -> None:
    strangers = Strangers()
    for address, times in (("10.0.0.7", 2), ("10.0.0.5", 5), ("10.0.0.9", 1)):
        for _ in range(times):
            strangers.note(address, "wrong proof", 0.0, agent=True)
    strangers.note("10.0.0.1", "a port scan's garbage", 0.0)
    assert strangers.agents() == "10.0.0.5 (5x), 10.0.0.7 (2x), 10.0.0.9 (1x)"
    assert strangers.agents(most=1) == "10.0.0.5 (5x) and 2 more"
