"""The PMI-1 line codec: MPICH's grammar, the limits, the stream splitter."""

from __future__ import annotations

import pytest

from launcher.errors import DtrainError, PmiError
from launcher.pmi.codec import (
    MAX_LINE,
    LineBuffer,
    PmiProtocolError,
    SpawnBlock,
    format_reply,
    parse_line,
    parse_mcmd_line,
)


def test_a_put_as_mpich_sends_it_parses_into_command_and_attributes():
    cmd = parse_line(b"cmd=put kvsname=kvs_1 key=-allgather-1-0-seg-1/9 value=segments=9\n")
    assert cmd.cmd == "put"
    assert dict(cmd.attrs) == {"kvsname": "kvs_1", "key": "-allgather-1-0-seg-1/9",
                               "value": "segments=9"}
    assert not cmd.multiline


def test_a_command_without_attributes_parses_with_or_without_newline():
    assert parse_line(b"cmd=get_maxes").cmd == "get_maxes"
    assert parse_line(b"cmd=barrier_in\n").attrs == {}


def test_extra_spaces_between_attributes_are_accepted():
    cmd = parse_line(b"cmd=init   pmi_version=1  pmi_subversion=1  ")
    assert dict(cmd.attrs) == {"pmi_version": "1", "pmi_subversion": "1"}


def test_a_backslash_escapes_a_space_inside_a_value():
    assert parse_line(rb"cmd=put kvsname=k key=a value=x\ y\\z").get("value") == "x y\\z"


def test_values_read_the_same_with_and_without_escapes_anywhere_in_the_line():
    # Without a backslash a value is one scan to its space; with one before that space, the
    # escapes are undone; a backslash further on belongs to a later value only.
    cmd = parse_line(rb"cmd=put key=a value=plain,=#$ other=x\ y last=\\ tail=end")
    assert dict(cmd.attrs) == {"key": "a", "value": "plain,=#$", "other": "x y",
                               "last": "\\", "tail": "end"}
    assert parse_line(b"cmd=abort message=a \\b c").get("message") == "a b c"  # to the end


@pytest.mark.parametrize("line", ["cmd=put k\u00e9y=1", "cmd=put k\u0661=1", "cmd=put \u00e9=1"])
def test_a_key_with_a_letter_or_digit_outside_ascii_is_rejected(line):
    with pytest.raises(PmiProtocolError):
        parse_line(line.encode())


def test_abort_message_takes_the_rest_of_the_line_spaces_included():
    cmd = parse_line(b"cmd=abort exitcode=42 message=rank 3 ran out of memory")
    assert cmd.get("exitcode") == "42"
    assert cmd.get("message") == "rank 3 ran out of memory"


def test_the_first_of_a_repeated_key_wins_as_in_mpich():
    assert parse_line(b"cmd=get key=a key=b").get("key") == "a"


def test_a_bare_key_is_kept_with_an_empty_value():
    assert parse_line(b"cmd=barrier_in flag").get("flag") == ""


def test_mcmd_spawn_is_recognised_as_a_multiline_command():
    cmd = parse_line(b"mcmd=spawn\n")
    assert (cmd.cmd, cmd.multiline) == ("spawn", True)


def test_lines_inside_a_spawn_block_parse_as_key_value_to_end_of_line():
    assert parse_mcmd_line(b"arg1=hello world") == ("arg1", "hello world")
    assert parse_mcmd_line(b"endcmd") == ("endcmd", "")


@pytest.mark.parametrize("line, why", [
    (b"GET / HTTP/1.1", "does not start with cmd="),
    (b"", "does not start with cmd="),
    (b"cmd=", "empty cmd= name"),
    (b"cmd=put k\xffey=1", "not UTF-8"),
    (b"cmd=put key=a\x00b", "control character"),
    (b"cmd=put ke!y=1", "invalid character"),
    (b"cmd=put =1", "expected a key"),
    (b"mcmd=spawn nprocs=1", "nothing but the command name"),
])
def test_a_line_that_is_not_pmi_is_rejected_with_the_reason(line, why):
    with pytest.raises(PmiProtocolError, match=why):
        parse_line(line)


def test_a_line_over_the_limit_is_rejected_even_when_complete():
    with pytest.raises(PmiProtocolError, match="exceeds the 4096-byte limit"):
        parse_line(b"cmd=put kvsname=k key=a value=" + b"x" * MAX_LINE)


def test_the_protocol_error_is_a_dtrain_error_with_a_fix():
    with pytest.raises(PmiError) as info:
        parse_line(b"hello")
    assert isinstance(info.value, DtrainError)
    assert "PMI request rejected: line does not start with cmd=" in str(info.value)
    assert "PMI-1" in info.value.fix


def test_a_reply_puts_attributes_in_the_given_order_and_ends_with_newline():
    assert format_reply("maxes", rc=0, kvsname_max=256) == b"cmd=maxes rc=0 kvsname_max=256\n"


def test_a_reply_escapes_spaces_so_mpich_reads_the_value_back():
    data = format_reply("get_result", rc=0, value="a b\\c")
    assert data == b"cmd=get_result rc=0 value=a\\ b\\\\c\n"
    assert parse_line(data).get("value") == "a b\\c"


def test_a_reply_value_with_a_newline_is_a_programming_error():
    with pytest.raises(ValueError):
        format_reply("get_result", value="a\nb")


def test_the_line_buffer_returns_complete_lines_and_keeps_the_rest():
    buf = LineBuffer()
    assert buf.feed(b"cmd=init pmi_version=1\ncmd=get_") == [b"cmd=init pmi_version=1"]
    assert buf.pending == len(b"cmd=get_")
    assert buf.feed(b"maxes\n") == [b"cmd=get_maxes"]
    assert buf.pending == 0


def test_the_line_buffer_detects_an_oversized_line_before_its_newline():
    buf = LineBuffer()
    buf.feed(b"cmd=put value=" + b"x" * 4000)
    with pytest.raises(PmiProtocolError, match="unfinished line of 4097 bytes"):
        buf.feed(b"x" * 83)


def test_the_line_buffer_hands_back_the_lines_before_an_oversized_one():
    buf = LineBuffer(max_line=10)
    with pytest.raises(PmiProtocolError) as info:
        buf.feed(b"cmd=a\n" + b"y" * 11 + b"\ncmd=b\n")
    assert info.value.lines == (b"cmd=a",)


def test_the_line_buffer_refuses_everything_after_an_oversized_line():
    buf = LineBuffer(max_line=10)
    with pytest.raises(PmiProtocolError):
        buf.feed(b"z" * 11)
    with pytest.raises(PmiProtocolError, match="after a rejected line"):
        buf.feed(b"cmd=a\n")


def test_a_line_of_exactly_the_limit_is_accepted():
    buf = LineBuffer(max_line=10)
    assert buf.feed(b"x" * 10 + b"\n") == [b"x" * 10]


def test_a_spawn_block_ends_at_the_endcmd_of_its_last_command():
    block = SpawnBlock()
    lines = [b"nprocs=1", b"totspawns=2", b"endcmd", b"mcmd=spawn", b"nprocs=3", b"endcmd"]
    assert [block.feed(line) for line in lines] == [False] * 5 + [True]


@pytest.mark.parametrize("lines, why", [
    ([b"nprocs=1", b"endcmd"], "without totspawns"),
    ([b"totspawns=0"], "totspawns='0'"),
    ([b"totspawns=x"], "totspawns='x'"),
    ([b"=1"], "expected a key"),
])
def test_a_malformed_spawn_block_is_a_protocol_error(lines, why):
    block = SpawnBlock()
    with pytest.raises(PmiProtocolError, match=why):
        for line in lines:
            block.feed(line)
