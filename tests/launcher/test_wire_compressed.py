"""Large JSON objects travel compressed (`launcher.wire.COMPRESS_FROM`): a fence's business
cards, pushed to every host, are hex text that compresses several times over."""

from __future__ import annotations

import json
import zlib

import pytest

from launcher import wire

# Cards as MPICH writes them: hex of its addresses, runs of zeros written as [n]
CARDS = {f"-allgather-1-{r}-seg-{s}/10": f"{r:04X}2E0A[7]{s:02X}D05D8E7255[2]" * 24
         for r in range(64) for s in range(10)}


def _frame(data: bytes) -> wire.Frame:
    frames = wire.Decoder().feed(data)
    assert len(frames) == 1
    return frames[0]


def test_a_fence_of_cards_is_sent_compressed_and_read_back_unchanged():
    msg = {"op": "barrier_out", "kv": CARDS}
    data = wire.encode_json(wire.Kind.PMI, msg)
    plain = len(json.dumps(msg, separators=(",", ":")))
    assert plain >= wire.COMPRESS_FROM and len(data) < plain / 3
    frame = _frame(data)
    assert frame.payload[:1] == wire.COMPRESSED
    assert frame.json() == msg


def test_a_shared_encoding_of_many_cards_is_compressed_too():
    msg = {"op": "barrier_out", "hosts": [1, 2], "kv": CARDS}
    data = wire.encode_json_shared(wire.Kind.PMI, msg, "kv", wire.encode_value(CARDS))
    frame = _frame(data)
    assert frame.payload[:1] == wire.COMPRESSED and frame.json() == msg


@pytest.mark.parametrize("cards", [CARDS, {"bc-0": "x" * 100}])
def test_a_relay_reads_how_a_frame_opens_without_decoding_the_rest(cards):
    """A relay picks a fetch's answer out of what passes down by its first bytes, inflated
    when compressed (large or not), and forwards it as it came."""
    payload = _frame(wire.encode_json(wire.Kind.PMI, {"op": "cards", "kv": cards})).payload
    assert (payload[:1] == wire.COMPRESSED) == (cards is CARDS)
    assert wire.opens(payload, b'{"op":"cards"')
    assert not wire.opens(payload, b'{"op":"push"')
    other = _frame(wire.encode_json(wire.Kind.PMI, {"op": "push", "kv": cards})).payload
    assert not wire.opens(other, b'{"op":"cards"')
    assert not wire.opens(b"x\x9c not zlib at all", b'{"op":"cards"')


@pytest.mark.parametrize("cards", [CARDS, {"bc-0": "x" * 100}])
def test_a_relay_reads_a_message_through_a_view_into_the_frame_as_it_came(cards):
    """What a relay reads of a PMI frame passing by (a child's message, a fetch's answer) it
    reads in place, compressed or not: the frame goes on as it came."""
    msg = {"op": "cards", "kv": cards}
    payload = memoryview(wire.encode_json(wire.Kind.PMI, msg))[5:]
    assert wire.opens(payload, b'{"op":"cards"') and not wire.opens(payload, b'{"op":"push"')
    assert wire.decode_json(wire.Kind.PMI, payload) == msg


def test_a_small_object_travels_as_plain_json():
    msg = {"op": "get_result", "req": 3, "found": True, "value": "x" * 1000}
    frame = _frame(wire.encode_json(wire.Kind.PMI, msg))
    assert frame.payload.startswith(b"{") and frame.json() == msg


@pytest.mark.parametrize("payload, why", [
    (b"x\x9c not zlib at all", "not valid compressed JSON"),
    (zlib.compress(b'{"op": "cards"}' * 100, 1)[:-9], "cut short"),
    (zlib.compress(b" " * (wire.MAX_JSON + 1), 1), f"inflates beyond {wire.MAX_JSON}"),
])
def test_a_bad_compressed_frame_is_one_wire_error(payload, why):
    with pytest.raises(wire.WireError, match=why):
        wire.Frame(wire.Kind.PMI, payload).json()


def test_a_relay_splits_a_routed_payload_into_its_frames_as_they_came():
    cards = wire.encode_json(wire.Kind.PMI, {"op": "cards", "kv": CARDS})
    beat = wire.encode(wire.Kind.HEARTBEAT)
    assert wire.split(cards) == [cards] and wire.split(cards)[0] is cards  # no copy
    assert wire.split(beat + cards + beat[:3]) == [beat, cards]  # a cut frame is left


@pytest.mark.parametrize("frames", [
    b"", wire.encode(wire.Kind.HEARTBEAT),
    wire.encode(wire.Kind.HEARTBEAT) + wire.encode_json(wire.Kind.PMI, {"kv": CARDS})])
def test_a_routed_frame_is_a_frame_of_the_hosts_index_and_its_frames(frames):
    """One header for the index and the frames, as `encode` writes any frame."""
    routed = wire.encode_routed(70000, frames)
    assert routed == wire.encode(wire.Kind.ROUTED, (70000).to_bytes(4, "big") + frames)
    assert wire.decode_routed(_frame(routed)) == (70000, frames)


def test_an_output_frame_is_a_frame_of_the_rank_the_stream_and_the_bytes():
    data = b"50%\r\xff\n" * 1000  # raw: a progress bar, not UTF-8
    output = wire.encode_output(70000, 2, data)
    assert output == wire.encode(wire.Kind.OUTPUT, (70000).to_bytes(4, "big") + b"\2" + data)
    assert wire.decode_output(_frame(output)) == wire.Output(70000, 2, data)


def test_a_routed_frame_is_refused_where_the_frame_it_is_would_be():
    fits = bytes(wire.MAX_FRAME - 5)  # with the index and the kind byte: MAX_FRAME
    assert len(wire.encode_routed(1, fits)) == 4 + wire.MAX_FRAME
    for encode in (lambda f: wire.encode_routed(1, f),
                   lambda f: wire.encode(wire.Kind.ROUTED, bytes(4) + f)):
        with pytest.raises(wire.WireError, match=f"ROUTED frame of {wire.MAX_FRAME} bytes"):
            encode(fits + b"\0")


def test_a_relay_reads_a_childs_frames_as_they_came_whatever_the_chunking():
    frames = [wire.encode(wire.Kind.HEARTBEAT), wire.encode_output(3, 1, b"x\r\ny"),
              wire.encode_json(wire.Kind.PMI, {"op": "cards", "kv": CARDS})]
    data, decoder, got = b"".join(frames), wire.Decoder(), []
    for at in range(0, len(data), 1000):  # the cards arrive in many reads
        got += decoder.feed_raw(data[at:at + 1000])
    assert got == frames and decoder.pending == 0
    with pytest.raises(wire.WireError, match="unknown frame kind 255"):
        wire.Decoder().feed_raw(b"\0\0\0\1\xff")  # checked as `feed` checks it
