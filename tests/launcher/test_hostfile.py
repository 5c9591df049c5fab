"""Hostfile and -H parsing: every accepted form and every refusal, with its path:line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from launcher.errors import HostfileError, UsageError
from launcher.hosts.hostfile import (
    MAX_LINE_CHARS,
    HostEntry,
    local_hosts,
    parse_host_list,
    parse_hostfile,
    parse_hostfile_text,
    validate_host_name,
)

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, content: str | bytes, name: str = "hosts") -> Path:
    path = tmp_path / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


def refused(text: str, source: str = "hf") -> HostfileError:
    with pytest.raises(HostfileError) as info:
        parse_hostfile_text(text, source)
    return info.value


# --- accepted forms -------------------------------------------------------------------------

def test_deepspeed_line_gives_host_and_slots_with_its_source_line():
    (entry,) = parse_hostfile_text("# cluster\n\nnode1 slots=4\n", "hf")
    assert entry == HostEntry("node1", 4, source="hf:3")


def test_open_mpi_keys_are_accepted_in_any_order():
    (entry,) = parse_hostfile_text("node1 port=2222 max_slots=8 slots=4", "hf")
    assert (entry.slots, entry.max_slots, entry.port) == (4, 8, 2222)


def test_open_mpi_max_slots_dash_spelling_is_accepted():
    (entry,) = parse_hostfile_text("node1 slots=2 max-slots=2", "hf")
    assert entry.max_slots == 2


def test_user_at_host_sets_the_login_user():
    (entry,) = parse_hostfile_text("alice@node1 slots=2", "hf")
    assert (entry.user, entry.name, entry.slots) == ("alice", "node1", 2)


def test_hydra_user_key_sets_the_login_user():
    (entry,) = parse_hostfile_text("node1:2 user=bob", "hf")
    assert (entry.user, entry.slots) == ("bob", 2)


def test_bare_host_is_one_slot():
    (entry,) = parse_hostfile_text("node1", "hf")
    assert entry.slots == 1


def test_mpich_host_colon_count_gives_slots():
    entries = parse_hostfile_text("node1:4\nnode2:2\n", "hf")
    assert [(e.name, e.slots) for e in entries] == [("node1", 4), ("node2", 2)]


def test_comments_at_line_end_and_indentation_are_ignored():
    entries = parse_hostfile_text("  node1 slots=2   # first\n\tnode2 slots=1\t\n#x\n", "hf")
    assert [(e.name, e.slots, e.source) for e in entries] == [("node1", 2, "hf:1"),
                                                               ("node2", 1, "hf:2")]


def test_crlf_line_ends_are_accepted():
    entries = parse_hostfile_text("node1 slots=2\r\nnode2 slots=2\r\n", "hf")
    assert [e.name for e in entries] == ["node1", "node2"]


def test_order_of_lines_is_kept():
    names = [e.name for e in parse_hostfile_text("c\nb\na\n", "hf")]
    assert names == ["c", "b", "a"]


def test_bracketed_ipv6_address_is_accepted_with_and_without_count():
    entries = parse_hostfile_text("[fe80::1]:2\n[::1] slots=3\n", "hf")
    assert [(e.name, e.slots) for e in entries] == [("fe80::1", 2), ("::1", 3)]
    assert entries[1].is_local


def test_ip_addresses_and_ssh_aliases_are_accepted():
    names = [e.name for e in parse_hostfile_text("10.0.0.7\ngpu_box-2.lab\n", "hf")]
    assert names == ["10.0.0.7", "gpu_box-2.lab"]


def test_localhost_loopback_addresses_are_local_and_other_names_are_not():
    assert HostEntry("localhost", 1).is_local and HostEntry("LOCALHOST", 1).is_local
    assert HostEntry("127.0.0.1", 1).is_local and HostEntry("::1", 1).is_local
    assert not HostEntry("node1", 1).is_local


def test_utf8_byte_order_mark_is_ignored(tmp_path):
    (entry,) = parse_hostfile(write(tmp_path, b"\xef\xbb\xbfnode1 slots=2\n"))
    assert entry.name == "node1"


def test_parse_hostfile_sources_name_the_path_and_line(tmp_path):
    path = write(tmp_path, "\nnode1 slots=2\n")
    (entry,) = parse_hostfile(path)
    assert entry.source == f"{path}:2"


@pytest.mark.parametrize("name", ["localhost", "cluster.example", "mpich.example"])
def test_example_hostfiles_parse(name):
    entries = parse_hostfile(REPO / "hostfiles" / name)
    assert entries and all(e.slots >= 1 for e in entries)


def test_example_cluster_hostfile_is_two_hosts_of_four():
    entries = parse_hostfile(REPO / "hostfiles" / "cluster.example")
    assert [e.slots for e in entries] == [4, 4]


# --- file-level errors ----------------------------------------------------------------------

def test_missing_hostfile_is_refused_naming_the_file(tmp_path):
    with pytest.raises(HostfileError, match="hostfile not found") as info:
        parse_hostfile(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(info.value)


def test_directory_as_hostfile_is_refused_naming_it(tmp_path):
    with pytest.raises(HostfileError, match="directory") as info:
        parse_hostfile(tmp_path)
    assert str(tmp_path) in str(info.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_hostfile_is_refused_naming_it(tmp_path):
    path = write(tmp_path, "node1\n")
    path.chmod(0)
    with pytest.raises(HostfileError, match="unreadable"):
        parse_hostfile(path)


def test_empty_hostfile_is_refused_naming_the_file(tmp_path):
    path = write(tmp_path, "")
    with pytest.raises(HostfileError, match="empty") as info:
        parse_hostfile(path)
    assert str(path) in str(info.value)


def test_hostfile_of_only_comments_is_refused(tmp_path):
    path = write(tmp_path, "# nothing\n\n   # here\n")
    with pytest.raises(HostfileError, match="no hosts") as info:
        parse_hostfile(path)
    assert str(path) in str(info.value)


def test_non_utf8_hostfile_is_refused_with_the_line(tmp_path):
    path = write(tmp_path, b"node1\nnode\xff2\n")
    with pytest.raises(HostfileError, match="UTF-8") as info:
        parse_hostfile(path)
    assert f"{path}:2" in str(info.value)


def test_hostfile_from_a_pipe_is_read(tmp_path):
    read_fd, write_fd = os.pipe()
    os.write(write_fd, b"node1 slots=2\n")
    os.close(write_fd)
    try:
        (entry,) = parse_hostfile(f"/dev/fd/{read_fd}")
    finally:
        os.close(read_fd)
    assert entry.slots == 2


# --- line-level errors ----------------------------------------------------------------------

def test_duplicate_host_is_rejected_naming_both_lines():
    err = refused("node1 slots=2\nnode2\nNODE1 slots=2\n")
    assert err.where == "hf:3" and "hf:1" in err.why


@pytest.mark.parametrize("line, fragment", [
    ("node1 slots=0", "at least 1"),
    ("node1 slots=-1", "not a whole number"),
    ("node1 slots=abc", "not a whole number"),
    ("node1 slots=", "not a whole number"),
    ("node1 slots=4_0", "not a whole number"),
    ("node1 slots=+4", "not a whole number"),
    ("node1:0", "at least 1"),
    ("node1:x", "not a whole number"),
    ("node1 slots=100000", "more than"),
])
def test_bad_slot_counts_are_rejected_with_the_line(line, fragment):
    err = refused("node0\n" + line)
    assert err.where == "hf:2" and fragment in str(err)


def test_slots_above_max_slots_are_rejected():
    err = refused("node1 slots=8 max_slots=4")
    assert err.where == "hf:1" and "max_slots=4" in err.why


def test_bad_max_slots_value_is_rejected():
    assert "max_slots" in str(refused("node1 max_slots=zero"))


def test_misspelled_slots_key_suggests_slots():
    err = refused("node1 slot=4")
    assert err.where == "hf:1" and "slots=" in err.fix


def test_unknown_key_without_near_match_lists_known_keys():
    err = refused("node1 binding=core")
    assert "Known keys" in err.fix


def test_repeated_key_is_rejected():
    assert "twice" in str(refused("node1 slots=2 slots=3"))


def test_count_given_as_colon_and_slots_is_rejected():
    assert "given twice" in str(refused("node1:2 slots=2"))


def test_user_given_twice_is_rejected():
    assert "user" in str(refused("a@node1 user=b"))


def test_trailing_junk_after_the_host_is_rejected():
    err = refused("node1 slots=4 extra")
    assert err.where == "hf:1" and "'extra'" in err.why


@pytest.mark.parametrize("port", ["0", "65536", "ssh", "-1", ""])
def test_bad_port_is_rejected(port):
    err = refused(f"node1 port={port}")
    assert err.where == "hf:1" and "port" in err.what


def test_line_longer_than_the_limit_is_rejected():
    err = refused("node1\n" + "n" * (MAX_LINE_CHARS + 1))
    assert err.where == "hf:2" and "too long" in err.what


def test_overlong_message_does_not_echo_the_whole_line():
    err = refused("a" * 300)
    assert len(str(err)) < 400


@pytest.mark.parametrize("char", ["\x0b", "\x0c", "\x1b", "\x7f", "\x85", "\u2028"])
def test_control_characters_are_rejected_with_their_code(char):
    err = refused(f"node1{char}x slots=2")
    assert err.where == "hf:1" and f"U+{ord(char):04X}" in err.why


def test_carriage_return_inside_a_line_is_rejected():
    assert refused("node1\rslots=2\n").where == "hf:1"


@pytest.mark.parametrize("host, fragment", [
    ("-oProxyCommand=touch", "option"),
    ("h1;reboot", "shell syntax"),
    ("h1$(id)", "shell syntax"),
    ("h1`id`", "shell syntax"),
    ("h1|x", "shell syntax"),
    ("h1&", "shell syntax"),
    ("h1>x", "shell syntax"),
    ("h1'x", "shell syntax"),
    ('h1"x', "shell syntax"),
    ("h1*", "shell syntax"),
    ("h1?", "shell syntax"),
    ("h1!", "shell syntax"),
    ("~h1", "shell syntax"),
    ("h1\\x", "shell syntax"),
    ("h{1,2}", "shell syntax"),
    ("h1%h", "ssh expands"),
    ("^node1", "exclude"),
    ("+n1", "relative"),
    ("node\u00e9", "not allowed"),
    ("node\u200b1", "not allowed"),
    (".node1", "starts with '.'"),
    ("node1/x", "not allowed"),
    ("fe80::1", "IPv6"),
    ("slots=4", "host name comes first"),
])
def test_host_names_that_could_be_options_or_shell_syntax_are_rejected(host, fragment):
    err = refused(f"good\n{host} slots=1")
    assert err.where == "hf:2" and fragment in str(err)


def test_unbalanced_ipv6_bracket_is_rejected():
    err = refused("[fe80::1 slots=1")
    assert err.where == "hf:1" and "unbalanced '['" in err.why


def test_non_ipv6_text_in_brackets_is_rejected():
    assert "not an IPv6" in str(refused("[node1]:2"))


def test_ipv6_zone_index_is_rejected():
    assert "not an IPv6" in str(refused("[fe80::1%eth0]"))


@pytest.mark.parametrize("user", ["", "-oX", "a;b", "a%b", "root$", "1abc"])
def test_bad_user_names_are_rejected(user):
    err = refused(f"{user}@node1")
    assert err.where == "hf:1" and "user" in err.what


def test_two_at_signs_are_rejected():
    assert "'@'" in str(refused("a@b@node1"))


def test_too_long_host_name_is_rejected():
    with pytest.raises(HostfileError, match="253"):
        validate_host_name("a" * 254, "x")


def test_validate_host_name_accepts_plain_names_and_addresses():
    for name in ("node1", "10.1.2.3", "a.b-c_d", "::1", "fe80::1"):
        validate_host_name(name, "x")


def test_validate_host_name_names_the_place():
    with pytest.raises(HostfileError) as info:
        validate_host_name("a b", "somewhere:9")
    assert info.value.where == "somewhere:9"


def test_host_entry_built_in_code_is_validated():
    with pytest.raises(HostfileError):
        HostEntry("-x", 1)
    with pytest.raises(HostfileError):
        HostEntry("node1", 0)


# --- -H lists and localhost ----------------------------------------------------------------

def test_inline_host_list_gives_counts_and_defaults_to_one():
    entries = parse_host_list("node1:4,node2, alice@node3:2")
    assert [(e.name, e.slots, e.user, e.source) for e in entries] == [
        ("node1", 4, None, "-H"), ("node2", 1, None, "-H"), ("node3", 2, "alice", "-H")]


def test_inline_host_list_accepts_bracketed_ipv6():
    (entry,) = parse_host_list("[::1]:2")
    assert (entry.name, entry.slots) == ("::1", 2)


@pytest.mark.parametrize("spec, where", [
    ("node1,,node2", "-H item 2"),
    ("node1,", "-H item 2"),
    ("node1:0", "-H item 1"),
    ("node1,node2:x", "-H item 2"),
    ("node1,h;id", "-H item 2"),
    ("node1,node1:2", "-H item 2"),
    ("node1 slots=2", "-H item 1"),
])
def test_bad_inline_host_lists_name_the_item(spec, where):
    with pytest.raises(HostfileError) as info:
        parse_host_list(spec)
    assert info.value.where == where


def test_empty_inline_host_list_is_refused():
    with pytest.raises(HostfileError, match="empty"):
        parse_host_list("  ")


def test_local_hosts_is_localhost_with_n_ranks():
    assert local_hosts(3) == [HostEntry("localhost", 3, source="localhost")]
    assert local_hosts(3)[0].is_local


@pytest.mark.parametrize("n", [0, -1, 100000])
def test_local_hosts_rejects_bad_counts(n):
    with pytest.raises(UsageError, match="--nproc-per-node"):
        local_hosts(n)


def test_path_through_a_regular_file_is_refused_as_unreadable(tmp_path):
    path = write(tmp_path, "node1\n") / "hosts"
    with pytest.raises(HostfileError, match="unreadable") as info:
        parse_hostfile(path)
    assert str(path) in str(info.value)
