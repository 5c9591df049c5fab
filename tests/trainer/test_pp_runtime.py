"""The pipeline runtime on real MPI processes (mpiexec -n 2 and 4), and the timeline outputs.

The worker (`tests/support/pp_workers/equivalence.py`) runs every schedule case of its `CASES` with
`run_schedule` on synthetic linear stages and saves what each rank saw; the serial reference
(the same stages one after the other in this process, `tests.support.pp_workers.stages.serial`)
gives
the losses and gradients the pipelined run must reproduce. Both run in fp64 and differ at most
in the order microbatch gradients are added, so they agree to the fp64 reduction bound over the
m x ROWS x WIDTH terms of a gradient element (tests/support/numerics.py); every term is a product
of a
weight or bias (|w| < 2), an activation (tanh, or an input |x| < 6 for these seeded normals)
and a loss gradient (< 1), hence at most 12.

Timings are never asserted (this machine is shared): the timeline is checked for structure and
causality only. The worker starts each step at one common clock reading (rank 0's, broadcast)
so events of different ranks on this host compare exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.mpi_runs import world_run
from tests.support.numerics import f64, reduction_rtol
from tests.support.pp_workers.equivalence import CASES, case_name
from tests.support.pp_workers.stages import ROWS, WIDTH, serial
from trainer.parallel.pipeline.runtime import P2PSpec, check_boundary
from trainer.parallel.pipeline.schedule import ScheduleError, chunks_of
from trainer.parallel.pipeline.timeline import Event, bubble, chrome_trace, theory, write_gantt

TERMS = max(c[1] for cases in CASES.values() for c in cases) * ROWS * WIDTH  # the most m
RTOL = reduction_rtol(TERMS)
ATOL = RTOL * TERMS * 12


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"pp{n}")
def world(request: pytest.FixtureRequest) -> tuple[int, Path, list[dict]]:
    """(p, output dir, what every rank of one ``mpiexec -n p`` worker run saw, by rank)."""
    run = world_run("tests.support.pp_workers.equivalence:run", request.param)
    return request.param, run.out, run.ranks


def _cases(world):
    p, _, ranks = world
    for case in CASES[p]:
        name, m, v, _ = case
        yield case_name(case), m, chunks_of(name, v), [r[case_name(case)] for r in ranks]


def test_pipelined_losses_equal_the_serial_run_for_every_schedule(world):
    p = world[0]
    for name, m, v, per_rank in _cases(world):
        losses, _ = serial(v * p, m)
        got = per_rank[-1]["losses"]  # the last stage runs on the last rank
        assert sorted(got) == list(range(m)), name
        torch.testing.assert_close(f64([got[mb] for mb in range(m)]), f64(losses),
                                   rtol=RTOL, atol=ATOL, msg=name)
        assert all(not r["losses"] for r in per_rank[:-1]), name


def test_pipelined_gradients_equal_the_serial_run_on_every_stage(world):
    p = world[0]
    for name, m, v, per_rank in _cases(world):
        _, grads = serial(v * p, m)
        seen = {}
        for r in per_rank:
            seen.update(r["grads"])
        assert sorted(seen) == list(range(v * p)), name
        for s, got in seen.items():
            for param, g in got.items():
                torch.testing.assert_close(g, grads[s][param], rtol=RTOL, atol=ATOL,
                                           msg=f"{name} stage {s} {param}")


def test_the_runtime_holds_as_many_activations_as_the_static_checker_predicts(world):
    p = world[0]
    for name, m, _, per_rank in _cases(world):
        for rank, r in enumerate(per_rank):
            assert r["max_in_flight"] == r["predicted_in_flight"], (name, rank)
            assert r["left_saved"] == 0, (name, rank)  # every forward's state was released
            if name.startswith("1f1b"):
                assert r["max_in_flight"] <= p - rank
            if name.startswith("gpipe"):
                assert r["max_in_flight"] == m
    gpipe = next(c for c in _cases(world) if c[0].startswith("gpipe"))
    assert gpipe[3][0]["peak_bytes"] > 0


def test_every_rank_gathers_the_same_timeline_with_one_f_and_one_b_per_microbatch_and_chunk(
        world):
    p = world[0]
    for name, m, v, per_rank in _cases(world):
        events = per_rank[0]["events"]
        assert all(r["events"] == events for r in per_rank), name
        for rank in range(p):
            done = sorted((e["kind"], e["microbatch"], e["chunk"]) for e in events
                          if e["rank"] == rank and e["kind"] in ("F", "B"))
            assert done == sorted((k, mb, c) for k in "FB" for mb in range(m)
                                  for c in range(v)), (name, rank)


def test_the_timeline_is_causal_across_ranks(world):
    """F of stage s starts after F of stage s-1 ended; B of stage s after B of stage s+1 and
    after its own F (clocks of processes on one host agree)."""
    p = world[0]
    for name, m, v, per_rank in _cases(world):
        at = {(e["kind"], e["microbatch"], e["chunk"] * p + e["rank"]): e
              for e in per_rank[0]["events"] if e["kind"] in ("F", "B")}
        last = v * p - 1
        for mb in range(m):
            for s in range(last + 1):
                f, b = at[("F", mb, s)], at[("B", mb, s)]
                assert f["end"] <= b["start"], (name, mb, s)
                if s > 0:
                    assert at[("F", mb, s - 1)]["end"] <= f["start"], (name, mb, s)
                if s < last:
                    assert at[("B", mb, s + 1)]["end"] <= b["start"], (name, mb, s)


def test_ranks_that_disagree_on_the_p2p_shape_all_fail_with_every_shape_named(world):
    p, _, ranks = world
    for r in ranks:
        text = r["disagreement"]
        assert text.startswith("pipeline ranks disagree on the p2p tensor"), text
        assert all(f"rank {k}: (4, {8 + k})" in text for k in range(p)), text


def test_rank_0_writes_a_perfetto_trace_and_a_gantt_png_of_the_real_run(world):
    p, out, ranks = world
    trace = json.loads((out / "trace.json").read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {f"rank {r}" for r in range(p)}
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    first = case_name(CASES[p][0])
    assert len(complete) == len(ranks[0][first]["events"])
    assert {e["cat"] for e in complete} == {"F", "B", "P2P"}
    assert (out / "gantt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- timeline and boundary checks without MPI -----------------------------------------------


def _two_rank_gpipe() -> list[Event]:
    """A hand-made p=2, m=2 GPipe step with unit forwards and double backwards."""
    spans = {0: [("F", 0, 0, 1), ("F", 1, 1, 2), ("B", 1, 5, 7), ("B", 0, 7, 9)],
             1: [("F", 0, 1, 2), ("F", 1, 2, 3), ("B", 1, 3, 5), ("B", 0, 5, 7)]}
    return [Event(r, k, mb, 0, s, e) for r, items in spans.items() for k, mb, s, e in items]


def test_bubble_is_idle_over_compute_per_rank_and_matches_the_formula_for_an_ideal_step():
    stats = bubble(_two_rank_gpipe(), 2)
    assert stats.span == 9 and stats.busy == (6, 6)
    assert stats.idle_over_busy == (0.5, 0.5) == (theory("gpipe", 2, 2),) * 2
    assert stats.idle_over_span == pytest.approx((1 / 3, 1 / 3))
    assert theory("interleaved", 4, 8, 2) == 3 / 16


def test_chrome_trace_has_one_thread_per_rank_and_events_in_microseconds():
    trace = chrome_trace(_two_rank_gpipe(), title="demo")
    threads = [e for e in trace["traceEvents"] if e["name"] == "thread_name"]
    assert [t["args"]["name"] for t in threads] == ["rank 0", "rank 1"]
    b0 = next(e for e in trace["traceEvents"] if e["name"] == "B0" and e["tid"] == 0)
    assert (b0["ts"], b0["dur"], b0["ph"], b0["cat"]) == (7e6, 2e6, "X", "B")


def test_gantt_png_is_written_for_stacked_panels(tmp_path):
    events = _two_rank_gpipe()
    path = write_gantt(tmp_path / "sub" / "g.png", [], panels=[("a", events), ("b", events)])
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_a_stage_output_that_does_not_fit_the_agreed_shape_is_refused_before_sending():
    spec = P2PSpec((4, 8))
    check_boundary(torch.zeros(4, 8), spec, "here")
    with pytest.raises(ScheduleError, match=r"is \(4, 9\) torch.float32, the pipeline agreed on "
                                            r"\(4, 8\) torch.float32"):
        check_boundary(torch.zeros(4, 9), spec, "pp rank 0, stage 0, SEND_F0->1")
    with pytest.raises(ScheduleError, match="torch.float16"):
        check_boundary(torch.zeros(4, 8, dtype=torch.float16), spec, "here")


def test_the_pipeline_bench_in_a_tiny_configuration_returns_well_formed_rows(tmp_path):
    from bench import pipeline

    rows = pipeline.run(ps=(2,), ms=(2,), forward_ms=1.0, act_mb=0.25, reps=1, results=tmp_path)
    assert [r["schedule"] for r in rows] == ["gpipe", "1f1b", "interleaved v=2"]
    for r in rows:
        assert r["step_ms"] > 0 and r["bubble"] >= 0 and r["ideal"] == pytest.approx(r["theory"])
        assert "events" not in r
    json.dumps(rows)  # bench.run_all saves them as JSON
    gpipe, one_f_one_b, _ = rows
    assert (gpipe["in_flight"], one_f_one_b["in_flight"]) == (2, 2)
    assert one_f_one_b["mem_target"] == 1.0 and gpipe["mem_vs_gpipe"] == 1.0
    assert one_f_one_b["vs_1f1b"] == 1.0
    assert (tmp_path / "pipeline_timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "pipeline_1f1b_p2_m2.trace.json").exists()
