"""--include/--exclude/--num-nodes/--nproc-per-node with DeepSpeed's semantics."""

from __future__ import annotations

import pytest

from launcher.errors import UsageError
from launcher.hosts.hostfile import parse_hostfile_text
from launcher.hosts.selection import HostSlots, select_hosts

HOSTS = parse_hostfile_text("node1 slots=4\nnode2 slots=4\nnode3 slots=2\n", "hf")


def layout(selected: list[HostSlots]) -> list[tuple[str, tuple[int, ...], bool]]:
    return [(h.entry.name, h.slots, h.restricted) for h in selected]


def usage_error(**options) -> UsageError:
    with pytest.raises(UsageError) as info:
        select_hosts(HOSTS, **options)
    return info.value


def test_no_options_selects_every_slot_of_every_host_unrestricted():
    assert layout(select_hosts(HOSTS)) == [("node1", (0, 1, 2, 3), False),
                                           ("node2", (0, 1, 2, 3), False),
                                           ("node3", (0, 1), False)]


def test_include_of_bare_hosts_keeps_whole_hosts_in_hostfile_order():
    assert layout(select_hosts(HOSTS, include="node3@node1")) == [
        ("node1", (0, 1, 2, 3), False), ("node3", (0, 1), False)]


def test_include_with_slots_restricts_that_host_only():
    assert layout(select_hosts(HOSTS, include="node1:0,1@node2")) == [
        ("node1", (0, 1), True), ("node2", (0, 1, 2, 3), False)]


def test_include_slots_are_sorted_and_deduplicated():
    assert layout(select_hosts(HOSTS, include="node1:3,1,3")) == [("node1", (1, 3), True)]


def test_include_of_the_same_host_twice_unions_the_slots():
    assert layout(select_hosts(HOSTS, include="node1:2@node1:0")) == [("node1", (0, 2), True)]


def test_include_of_a_bare_host_and_its_slots_means_the_whole_host():
    assert layout(select_hosts(HOSTS, include="node1:2@node1")) == [
        ("node1", (0, 1, 2, 3), False)]


def test_filter_host_names_match_case_insensitively():
    assert layout(select_hosts(HOSTS, include="NODE2:1")) == [("node2", (1,), True)]


def test_exclude_of_slots_keeps_the_rest_restricted():
    assert layout(select_hosts(HOSTS, exclude="node2:0,3")) == [
        ("node1", (0, 1, 2, 3), False), ("node2", (1, 2), True), ("node3", (0, 1), False)]


def test_exclude_of_a_bare_host_drops_it():
    assert [h.entry.name for h in select_hosts(HOSTS, exclude="node2")] == ["node1", "node3"]


def test_exclude_of_every_slot_of_a_host_drops_it():
    assert [h.entry.name for h in select_hosts(HOSTS, exclude="node3:0,1@node1:0")] == [
        "node1", "node2"]


def test_include_and_exclude_together_are_refused():
    assert "mutually exclusive" in str(usage_error(include="node1", exclude="node2"))


def test_unknown_host_in_filter_is_named_with_the_known_hosts():
    err = usage_error(include="node1@node9")
    assert "'node9'" in err.why and "node1, node2, node3" in err.why


def test_unknown_host_message_lists_a_bounded_number_of_hosts():
    many = parse_hostfile_text("".join(f"n{i}\n" for i in range(40)), "hf")
    with pytest.raises(UsageError, match=r"and 28 more"):
        select_hosts(many, exclude="zz")


def test_slot_out_of_range_names_the_host_its_size_and_line():
    err = usage_error(include="node3:2")
    assert err.where == "--include node3:2" and "0..1" in err.why and "hf:3" in err.why


@pytest.mark.parametrize("spec", ["", "node1@", "@node1", "node1@@node2", "node1:",
                                  "node1:a", "node1:0,,1", "node1:-1", "[::1]x"])
def test_malformed_filters_are_refused(spec):
    err = usage_error(include=spec)
    assert err.where.startswith("--include")


def test_excluding_everything_is_refused():
    err = usage_error(exclude="node1@node2@node3")
    assert "no hosts left" in err.what and err.where == "--exclude"


def test_num_nodes_keeps_the_first_hosts():
    assert [h.entry.name for h in select_hosts(HOSTS, num_nodes=2)] == ["node1", "node2"]


def test_num_nodes_applies_after_the_filter():
    assert [h.entry.name for h in select_hosts(HOSTS, exclude="node1", num_nodes=1)] == [
        "node2"]


@pytest.mark.parametrize("n, fragment", [(0, "positive"), (-2, "positive"), (4, "only 3")])
def test_bad_num_nodes_is_refused(n, fragment):
    err = usage_error(num_nodes=n)
    assert "--num-nodes" in err.where and fragment in err.why


def test_nproc_per_node_keeps_the_first_slots_unrestricted():
    assert layout(select_hosts(HOSTS, nproc_per_node=2)) == [
        ("node1", (0, 1), False), ("node2", (0, 1), False), ("node3", (0, 1), False)]


def test_nproc_per_node_takes_the_first_of_the_filtered_slots():
    assert layout(select_hosts(HOSTS, exclude="node1:0@node3", nproc_per_node=2)) == [
        ("node1", (1, 2), True), ("node2", (0, 1), False)]


def test_nproc_per_node_above_a_hosts_slots_is_refused_naming_the_host():
    err = usage_error(nproc_per_node=3)
    assert "node3 has 2" in err.why and "hf:3" in err.why


def test_nproc_per_node_below_one_is_refused():
    assert "positive" in usage_error(nproc_per_node=0).why


def test_bracketed_ipv6_host_can_be_filtered():
    hosts = parse_hostfile_text("[::1] slots=2\nnode1\n", "hf")
    assert layout(select_hosts(hosts, include="[::1]:1")) == [("::1", (1,), True)]


def test_empty_host_list_is_refused():
    with pytest.raises(UsageError, match="no hosts left"):
        select_hosts([])
