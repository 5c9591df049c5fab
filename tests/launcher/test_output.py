"""The output path's pure cores and threads, in memory: the line splitter, the sink, the head's
output writer and the agent's frame writer (real threads, real pipes, no dtrain processes).

Linear time is shown by the splitter's own count of bytes scanned and copied when the input
doubles, never by wall-clock time.
"""

from __future__ import annotations

import io
import os
import threading
import time

import pytest

from launcher import wire
from launcher.agent.writer import FrameWriter
from launcher.output.lines import LINE_CAP, LineSplitter, prefix_lines
from launcher.output.sink import RAW_QUIET_S, OutputSink
from launcher.output.writer import OutputWriter


def _feed_all(splitter: LineSplitter, data: bytes, chunk: int) -> bytes:
    return b"".join(splitter.feed(data[i:i + chunk]) for i in range(0, len(data), chunk))


# -- the splitter ---------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 64, 4096])
def test_a_line_without_newline_costs_work_linear_in_its_length(chunk):
    work = {}
    for size in (64 * 1024, 128 * 1024, 256 * 1024):
        splitter = LineSplitter()
        out = _feed_all(splitter, b"y" * size + b"\n", chunk)
        assert out == b"y" * size + b"\n"
        work[size] = splitter.work
    # Doubling the line doubles the work (quadratic would quadruple it); per byte it is a
    # small constant however the bytes are chunked.
    assert work[128 * 1024] / work[64 * 1024] == pytest.approx(2.0, rel=0.01)
    assert work[256 * 1024] / work[128 * 1024] == pytest.approx(2.0, rel=0.01)
    assert work[256 * 1024] <= 6 * 256 * 1024


def test_many_short_lines_cost_work_linear_in_their_bytes():
    lines = b"".join(b"%d some text\n" % i for i in range(20000))
    small, large = LineSplitter(), LineSplitter()
    assert _feed_all(small, lines, 4096) == lines
    assert _feed_all(large, lines * 2, 4096) == lines * 2
    assert large.work / small.work == pytest.approx(2.0, rel=0.01)


def test_lines_come_out_whole_however_the_input_is_chunked():
    data = b"".join(b"line %d " % i + b"x" * (i * 37 % 300) + b"\n" for i in range(500))
    for chunk in (1, 7, 100, 4096, len(data)):
        splitter = LineSplitter()
        out = []
        for i in range(0, len(data), chunk):
            block = splitter.feed(data[i:i + chunk])
            assert block == b"" or block.endswith(b"\n")  # only whole lines, ever
            out.append(block)
        assert b"".join(out) == data and splitter.pending == 0


def test_a_line_longer_than_the_cap_arrives_in_pieces_of_the_cap_and_nothing_is_lost():
    splitter = LineSplitter(cap=10)
    out = _feed_all(splitter, b"a" * 25 + b"\n" + b"b" * 10 + b"\n", 3)
    assert out == b"a" * 10 + b"\n" + b"a" * 10 + b"\n" + b"a" * 5 + b"\n" + b"b" * 10 + b"\n"
    # The cap also holds when long lines come whole inside one chunk.
    assert LineSplitter(cap=4).feed(b"x\nabcdefghi\r\nyy\n") == b"x\nabcd\nefgh\ni\r\nyy\n"
    # And it bounds what is held for a line that never ends.
    splitter = LineSplitter(cap=10)
    splitter.feed(b"c" * 1000)
    assert splitter.pending <= 10
    assert LINE_CAP == 1 << 20


def test_raw_pieces_of_an_over_long_line_get_nothing_added():
    splitter = LineSplitter(cap=4, piece_end=b"")
    assert splitter.feed(b"abcdefghij") + splitter.rest(newline=False) == b"abcdefghij"


def test_carriage_returns_end_lines_and_a_split_crlf_stays_one_line_end():
    splitter = LineSplitter()
    assert splitter.feed(b"10%\r20%\r") == b"10%\r"      # the last \r waits for its next byte
    assert splitter.feed(b"\ndone") == b"20%\r\n"         # ... which was \n: one line end
    assert splitter.feed(b"\r") == b""
    assert splitter.feed(b"30%") == b"done\r"              # ... which was not
    assert splitter.rest(newline=True) == b"30%\n"
    assert splitter.rest(newline=True) == b""


def test_prefix_goes_before_every_line_and_never_inside_a_crlf():
    assert prefix_lines(b"a\nb\n", b"[0@h] ") == b"[0@h] a\n[0@h] b\n"
    assert prefix_lines(b"a\r\nb\rc\n\n", b"[1@h] ") == b"[1@h] a\r\n[1@h] b\r[1@h] c\n[1@h] \n"
    assert prefix_lines(b"a\\1\n", b"[\\1] ") == b"[\\1] a\\1\n"


def test_a_last_line_without_its_end_is_prefixed_whole():
    assert prefix_lines(b'{"host": "node4"}', b"[3@node4] ") == b'[3@node4] {"host": "node4"}'
    assert prefix_lines(b"a\nb", b"[0@h] ") == b"[0@h] a\n[0@h] b"


# -- the sink -------------------------------------------------------------------------------
def _sink(**kw) -> tuple[OutputSink, io.BytesIO, io.BytesIO]:
    out, err = io.BytesIO(), io.BytesIO()
    return OutputSink({0: "h0", 1: "h1"}, out, err, **kw), out, err


def test_each_batch_is_whole_prefixed_lines_and_ranks_never_mix_inside_a_line():
    sink, out, _ = _sink()
    sink.write(0, 1, b"one\ntw")
    sink.write(1, 1, b"uno\ndo")
    sink.write(0, 1, b"o\n")
    sink.commit()
    assert out.getvalue() == b"[0@h0] one\n[1@h1] uno\n[0@h0] two\n"
    sink.flush_rank(1)
    sink.commit()
    assert out.getvalue().endswith(b"[1@h1] do\n")


def test_a_prefixed_line_whose_end_comes_late_is_still_one_line():
    # print() under python -u writes the text and its newline apart; a loaded host can
    # deschedule the rank between the two for longer than the raw mode's quiet time.
    sink, out, _ = _sink()
    sink.write(0, 1, b'{"round": 1, "host": "node4"}', now=100.0)
    sink.flush_quiet(100.0 + 10 * RAW_QUIET_S)
    sink.commit()
    sink.write(1, 1, b"other\n", now=101.0)
    sink.write(0, 1, b"\n", now=101.0)
    sink.commit()
    assert out.getvalue() == b'[1@h1] other\n[0@h0] {"round": 1, "host": "node4"}\n'


def test_raw_mode_writes_a_partial_line_once_its_rank_is_quiet():
    sink, out, _ = _sink(raw=True)
    sink.write(0, 1, b"\x1b[2K50%\r", now=100.0)
    sink.flush_quiet(100.0)
    sink.commit()
    assert out.getvalue() == b""
    assert sink.raw_due(100.0) == pytest.approx(RAW_QUIET_S)
    sink.flush_quiet(100.0 + RAW_QUIET_S)
    sink.commit()
    assert out.getvalue() == b"\x1b[2K50%\r"
    assert sink.raw_due(200.0) is None


def test_the_stderr_tail_keeps_the_last_non_blank_lines_and_log_files_get_every_byte(tmp_path):
    sink, _, err = _sink(log_dir=tmp_path / "run")
    sink.write(1, 2, b"".join(b"err %d\n\n" % i for i in range(100)))
    sink.write(1, 1, b"out\n")
    sink.close()
    assert sink.tail(1) == [f"err {i}" for i in range(80, 100)]
    assert (tmp_path / "run" / "rank-1.log").read_bytes().endswith(b"err 99\n\nout\n")
    assert err.getvalue().count(b"[1@h1] err") == 100


# -- the head's output writer -----------------------------------------------------------------
class GatedStream(io.BytesIO):
    """A stdout whose reader can be paused: writes block while the gate is closed."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def write(self, data) -> int:  # type: ignore[override]
        self.gate.wait()
        return super().write(data)


def test_a_full_output_queue_blocks_the_producer_until_the_reader_catches_up():
    out = GatedStream()
    writer = OutputWriter(limit=1000)
    writer.start(OutputSink({0: "h"}, out, io.BytesIO(), prefix=False))
    produced = []

    def produce() -> None:
        for i in range(50):
            writer.put(0, 1, b"%04d" % i + b"." * 95 + b"\n")
            produced.append(i)

    t = threading.Thread(target=produce, daemon=True)
    t.start()
    time.sleep(0.5)
    assert len(produced) < 25  # held back by the bound: ~2 x 1000 bytes in flight at most
    out.gate.set()
    t.join(10)
    writer.flush_rank(0)
    writer.close()
    lines = out.getvalue().splitlines()
    assert [int(line[:4]) for line in lines] == list(range(50))


def test_an_exit_flush_and_a_notice_come_after_everything_the_rank_printed():
    out, err = io.BytesIO(), io.BytesIO()
    writer = OutputWriter()
    writer.start(OutputSink({0: "h"}, out, err))
    writer.put(0, 1, b"a\nunfinished")
    writer.flush_rank(0)
    writer.put(0, 2, b"boom\n")
    writer.notice("after boom")
    writer.drain()
    assert out.getvalue() == b"[0@h] a\n[0@h] unfinished\n"
    assert err.getvalue() == b"[0@h] boom\ndtrain: after boom\n"
    writer.close()


def test_abandon_releases_a_producer_blocked_on_a_stuck_reader():
    out = GatedStream()
    writer = OutputWriter(limit=30)
    writer.start(OutputSink({0: "h"}, out, io.BytesIO()))
    writer.put(0, 1, b"x" * 20 + b"\n")  # taken by the thread, which blocks in write
    writer.put(0, 1, b"y" * 20 + b"\n")  # queued: the queue is now full
    done = threading.Event()
    threading.Thread(target=lambda: (writer.put(0, 1, b"z\n"), done.set()), daemon=True).start()
    assert not done.wait(0.3)
    writer.abandon()
    assert done.wait(5)
    writer.drain()  # returns at once: abandoned
    out.gate.set()


# -- the agent's frame writer -----------------------------------------------------------------
def test_control_frames_never_block_while_rank_output_waits_for_a_slow_head():
    r, w = os.pipe()
    writer = FrameWriter(os.fdopen(w, "wb", buffering=0), limit=64 * 1024)
    chunk = wire.encode_output(0, 1, b"o" * 60000)
    sent = []

    def pump() -> None:
        for _ in range(40):  # 2.4 MB: far more than the pipe plus the queue hold
            writer.send_output(chunk)
            sent.append(1)

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    time.sleep(0.5)
    assert len(sent) < 10  # the pump is held back: nobody reads the pipe
    t0 = time.monotonic()
    assert writer.send(wire.encode(wire.Kind.HEARTBEAT))  # the main loop's send returns at once
    assert time.monotonic() - t0 < 0.5
    decoder, frames = wire.Decoder(), []
    while len(frames) < 41:
        frames += decoder.feed(os.read(r, 1 << 20))
    t.join(5)
    kinds = [f.kind for f in frames]
    assert kinds.count(wire.Kind.OUTPUT) == 40 and kinds.count(wire.Kind.HEARTBEAT) == 1
    assert writer.flush(5)
    os.close(r)


class _Sink:
    """A stream that records which thread wrote each piece, and can hold a write up."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, bytes]] = []
        self.gate = threading.Event()
        self.gate.set()

    def write(self, data: memoryview) -> int:
        self.gate.wait()
        self.writes.append((threading.current_thread().name, bytes(data)))
        return len(data)


def test_forwarded_frames_are_written_by_the_caller_when_nothing_waits_else_after_what_does():
    sink = _Sink()
    writer = FrameWriter(sink)
    first = wire.encode_json(wire.Kind.STARTED, {"rank": 1})
    assert writer.forward(first)
    assert sink.writes == [(threading.current_thread().name, first)]  # no writer thread's turn
    sink.gate.clear()  # the parent stops reading: the writer thread's next write is held
    beat = wire.encode(wire.Kind.HEARTBEAT)
    writer.send(beat)
    done = wire.encode_json(wire.Kind.DONE, {"code": 0})
    assert writer.forward(done)  # queued behind the heartbeat, not written past it
    sink.gate.set()
    assert writer.flush(5)
    assert b"".join(data for _, data in sink.writes) == first + beat + done


def test_a_broken_stream_releases_blocked_pumps_and_reports_false():
    r, w = os.pipe()
    writer = FrameWriter(os.fdopen(w, "wb", buffering=0), limit=1024)
    os.close(r)
    results = [writer.send_output(wire.encode_output(0, 1, b"x" * 2000)) for _ in range(3)]
    assert results[-1] is False and writer.broken
    assert writer.send(wire.encode(wire.Kind.HEARTBEAT)) is False


def test_a_stdout_that_fails_to_write_is_given_up_with_one_warning_and_the_sink_goes_on():
    err = io.BytesIO()
    with open("/dev/full", "wb") as full:  # every write fails with ENOSPC
        sink = OutputSink({0: "h"}, full, err)
        sink.write(0, 1, b"lost\n")
        sink.commit()
        sink.write(0, 1, b"more\n")
        sink.write(0, 2, b"still here\n")
        sink.commit()
    text = err.getvalue().decode()
    assert text.count("writing the ranks' output failed") == 1
    assert "No space left on device" in text and "[0@h] still here\n" in text
