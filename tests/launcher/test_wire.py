"""The typed SPEC: what the head sends is what the agent reads, and every default the head,
the agent and the command line use is written once, in the SPEC's records."""

from __future__ import annotations

import click
import pytest

from launcher import wire
from launcher.cli import launch
from launcher.head.options import SuperviseOptions
from records import replace


def _spec(**changes: object) -> wire.AgentSpec:
    base = wire.AgentSpec("job-1", ("python", "train.py", "--lr", "1e-3"), "/work",
                          (wire.RankStart(4, {"RANK": "4"}), wire.RankStart(5, {"RANK": "5"})),
                          watch=wire.Watch(0.5, 4, 2.0),
                          pmi=wire.PmiSpec("port", "job-1", 8, "(vector,(0,4,2))", 12.0),
                          progress_interval=0.25, probe=wire.Probe("10.0.0.2", free_port=True))
    return replace(base, **changes)


@pytest.mark.parametrize("probe", [wire.Probe("10.0.0.2", free_port=True), None])
def test_a_spec_survives_its_json_round_trip_unchanged(probe: wire.Probe | None) -> None:
    spec = _spec(probe=probe)
    frame = wire.Decoder().feed(wire.encode_json(wire.Kind.SPEC, spec.to_json()))[0]
    assert wire.AgentSpec.from_json(frame.json()) == spec


def test_a_round_and_a_spares_check_survive_the_round_trip() -> None:
    for spec in (_spec(rounds=True), _spec(ranks=(), check_env={"PATH": "/venv/bin"})):
        frame = wire.Decoder().feed(wire.encode_json(wire.Kind.SPEC, spec.to_json()))[0]
        assert wire.AgentSpec.from_json(frame.json()) == spec


def test_a_spec_without_progress_or_pmi_fields_reads_as_off_and_the_defaults() -> None:
    body = _spec().to_json()
    for key in ("progress", "pmi", "heartbeat", "misses", "grace", "probe"):
        del body[key]
    spec = wire.AgentSpec.from_json(body)
    assert spec.progress_interval is None and spec.probe is None
    assert spec.pmi == wire.PmiSpec() and spec.watch == wire.Watch()


@pytest.mark.parametrize(("field", "value", "named"), [
    ("ranks", [{"rank": "zero", "env": {}}], "rank is str, not int"),
    ("argv", "python train.py", "argv is str, not list"),
    ("pmi", {"mode": "fd", "colour": "blue"}, "colour"),
])
def test_a_malformed_spec_is_a_wire_error_naming_the_field(field: str, value: object,
                                                           named: str) -> None:
    body = {**_spec().to_json(), field: value}
    with pytest.raises(wire.WireError, match=named):
        wire.AgentSpec.from_json(body)


def test_the_heads_options_take_their_defaults_from_the_spec() -> None:
    opts = SuperviseOptions()
    assert opts.watch == wire.Watch()
    assert (opts.pmi, opts.pmi_stall) == (wire.PmiSpec().mode, wire.PmiSpec().stall)


def test_the_command_line_shows_the_defaults_of_the_records() -> None:
    defaults = {p.name: p.default for p in launch.params if isinstance(p, click.Option)}
    opts = SuperviseOptions()
    assert (defaults["heartbeat_interval"], defaults["grace"], defaults["pmi"],
            defaults["pmi_stall"], defaults["launch_timeout"], defaults["hang_timeout"]) == (
        opts.heartbeat, opts.grace, opts.pmi, opts.pmi_stall, opts.launch_timeout,
        opts.hang_timeout)


def test_a_frame_nested_past_the_parsers_recursion_limit_is_a_wire_error() -> None:
    frame = wire.Frame(wire.Kind.SPEC, b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(wire.WireError, match="SPEC frame is not JSON"):
        frame.json()
