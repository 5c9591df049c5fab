"""bench/output.py in a tiny configuration: every tool's run worked and lost nothing.

Rates are never asserted (this machine is shared); what is checked is that each row comes
from working runs, dtrain's lines arrived whole, and nothing is left on the hosts.
"""

from __future__ import annotations

import json

from bench import common, output


def test_output_bench_on_two_hosts_loses_nothing_under_every_tool(netns_cluster):
    tools = [t for t in output.TOOLS if common.tool_missing(t.split()[0]) is None]
    rows = output.run(hosts=2, per_host=1, lines=3000, long=5000, reps=1, tools=tools,
                      cluster=netns_cluster)
    assert [r["tool"] for r in rows] == tools
    for row in rows:
        assert row["ok"] == row["reps"] == 1, row.get("error")
        assert row["lines"] == 2 * 3002 and row["span_s"] > 0 and row["lines_per_s"] > 0
        if row["tool"].startswith("dtrain"):
            assert row["whole_lines"] == "1/1"
            if "hydra raw" in tools:
                assert isinstance(row["lines_per_s_vs_hydra"], float)
    json.dumps(rows)
    assert netns_cluster.wait_no_job_pids(5) == {}
