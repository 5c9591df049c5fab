"""The scale benches in tiny configurations: well-formed rows, never timings.

`bench.hosts_scale` on one namespace host under every tool here (dtrain flat, and tree when
this dtrain has --fanout; Hydra; pdsh), and `bench.sim_scale`'s fit of growth with N.
"""

from __future__ import annotations

import json
import math

import pytest

from bench import common, hosts_scale, sim_scale


def test_hosts_scale_times_every_tool_with_its_head_cpu_on_one_host(netns_cluster):
    tools = [t for t in hosts_scale.TOOLS
             if common.tool_missing("dtrain" if t.startswith("dtrain") else t) is None]
    rows = hosts_scale.run(hosts=(1,), reps=1, tools=tools, warmup=False,
                           cluster=netns_cluster)
    assert [r["tool"] for r in rows] == tools
    for row in rows:
        if row["tool"] == "dtrain-tree" and not hosts_scale.has_fanout():
            assert "no --fanout" in row["error"]
            continue
        assert row["ok"] == row["reps"] == 1, row.get("error")
        assert 0 < row["running_s"] <= row["exit_s"]
        assert row["cpu_s"] > 0 and row["tail_s"] >= 0
        assert row["machine_s"] > 0  # both sides of the host: /proc/stat's ticks, sampled
        if row["tool"] == "pdsh":
            assert row["world_s"] is None and row["wired_s"] is None  # no PMI: no MPI world
        else:
            assert row["running_s"] <= row["world_s"] <= row["exit_s"]
            assert row["wired_s"] == pytest.approx(row["world_s"] - row["running_s"])
    json.dumps(rows)
    assert netns_cluster.wait_no_job_pids(5) == {}


def test_the_growth_fit_recovers_a_line_and_an_n_log_n_curve():
    line = sim_scale.fit([(n, 2.0 + 0.5 * n) for n in (256, 512, 1024)])
    assert math.isclose(line["linear"]["a"], 2.0, abs_tol=1e-6)
    assert math.isclose(line["linear"]["b"], 0.5, rel_tol=1e-9)
    assert line["linear"]["rms"] < 1e-6 < line["nlogn"]["rms"]
    curve = sim_scale.fit([(n, 1.0 + 0.01 * n * math.log2(n)) for n in (256, 1024, 4096)])
    assert math.isclose(curve["nlogn"]["b"], 0.01, rel_tol=1e-9)
    assert curve["nlogn"]["rms"] < 1e-6 < curve["linear"]["rms"]
