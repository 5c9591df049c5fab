"""The launch benches and the bench runner in tiny configurations: well-formed rows only.

Timings are never asserted (this machine is shared and loaded); what is checked is that every
tool's run worked, every rank left its stamp, the derived columns exist, the ordering of events
is causal, and nothing is left running on the hosts afterwards.
"""

from __future__ import annotations

import json

import pytest

from bench import common, launch_time, recovery, rendezvous, run_all, slurm, wireup


def _usable(tools):
    return [t for t in tools if common.tool_missing(t) is None]


def _check_rows(rows, tools, keys):
    assert [r["tool"] for r in rows] == tools
    for row in rows:
        assert row["ok"] == row["reps"] == 1, row.get("error")
        assert (row["hosts"], row["ranks"]) == (1, 4)
        for key in keys:
            assert isinstance(row[f"{key}_s"], float) and row[f"{key}_s"] > 0, (key, row)
            assert row[f"{key}_min_s"] == row[f"{key}_s"]  # one repetition: median is min
        assert len(row["samples"]) == 1
    json.dumps(rows)  # run_all saves them as JSON


def test_launch_time_on_one_host_starts_every_rank_under_every_tool(netns_cluster):
    tools = _usable(launch_time.TOOLS)
    rows = launch_time.run(hosts=(1,), reps=1, tools=tools, warmup=False, cluster=netns_cluster)
    _check_rows(rows, tools, ("start", "first", "exit"))
    for row in rows:
        assert row["first_s"] <= row["start_s"] <= row["exit_s"]
        assert row["start_s_growth"] == 1.0
    if "hydra" in tools:
        assert isinstance(rows[0]["start_s_vs_hydra"], float)
    assert netns_cluster.wait_no_job_pids(5) == {}


def test_the_rendezvous_bench_on_one_host_starts_every_rank_under_every_tool(netns_cluster):
    tools = list(rendezvous.TOOLS)
    rows = rendezvous.run(hosts=(1,), reps=1, tools=tools, warmup=False, cluster=netns_cluster)
    _check_rows(rows, tools, ("start", "exit"))
    assert all(row["start_s"] <= row["exit_s"] for row in rows)
    assert isinstance(rows[0]["start_s_vs_torchrun"], float)
    assert netns_cluster.wait_no_job_pids(5) == {}


def test_wireup_on_one_host_forms_one_world_under_dtrain_and_hydra(netns_cluster):
    tools = _usable(wireup.TOOLS)
    rows = wireup.run(hosts=(1,), reps=1, tools=tools, warmup=False, cluster=netns_cluster)
    _check_rows(rows, tools, ("world", "barrier", "exit", "init"))
    for row in rows:
        assert row["world_s"] <= row["barrier_s"] <= row["exit_s"]
    assert netns_cluster.wait_no_job_pids(5) == {}


def test_the_slurm_bench_on_one_node_starts_every_rank_under_dtrain_and_srun(slurm_cluster):
    tools = ["dtrain-slurm", "srun"]  # dtrain-ssh needs sshd, which the test nodes lack
    rows = slurm.run(hosts=(1,), reps=1, tools=tools, warmup=False, cluster=slurm_cluster)
    _check_rows(rows, tools, ("start", "exit"))
    assert all(row["start_s"] <= row["exit_s"] for row in rows)
    assert isinstance(rows[0]["start_s_vs_srun"], float)
    assert slurm_cluster.wait_no_job_pids(5) == {}


def test_a_world_of_singletons_is_rejected_by_the_wireup_check():
    stamps = [{"rank": 0, "size": 1, "start": 0.0, "init": 1.0, "barrier": 1.0}] * 4
    assert "world sizes [1], expected 4" in wireup.one_world(stamps, 4)
    assert "3 of 4 ranks" in wireup.one_world(stamps[:3], 4)


def test_run_all_saves_json_and_a_markdown_summary_and_rejects_unknown_names(tmp_path, capsys):
    assert run_all.main(["--only", "pmi_scaling", "--quick", "--results", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("pmi_scaling-*.json")  # one file per run, named by its time
    saved = json.loads(path.read_text())
    assert saved["bench"] == "pmi_scaling" and saved["quick"] and saved["rows"]
    assert saved["commit"] and saved["machine"]["loadavg"]
    summary = (tmp_path / "summary.md").read_text()
    assert "## pmi_scaling" in summary and "| ranks |" in summary
    with pytest.raises(SystemExit) as exit_info:
        run_all.main(["--only", "no_such_bench", "--results", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "unknown bench no_such_bench" in capsys.readouterr().err


def test_the_recovery_bench_times_one_rank_crash_under_torchrun_and_under_dtrain():
    rows = recovery.run(reps=1, causes=())
    assert [r["tool"] for r in rows] == ["torchrun", "dtrain"]
    for row in rows:
        assert row["ok"] == 1, row.get("error")
        assert 0 < row["restart_s"] < row["total_s"]
    assert isinstance(rows[1]["restart_s_vs_torchrun"], float)
    json.dumps(rows)
