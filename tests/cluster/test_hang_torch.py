"""Hang diagnosis for unmodified torch.distributed programs (gloo), through torch's Flight
Recorder read from outside the program (`launcher.agent.flight`): 4 ranks on 2 namespace hosts,
one fault each; the headline names the culprit first with the operation, group and sequence
number, within the hang timeout plus 3 s of the last progress; nothing of the job is left.
"""

from __future__ import annotations

import json
import re

import pytest

from launcher.agent import flight
from tests.support import PYTHON, REPO, run_dtrain, run_with_link_cut

WORKER = str(REPO / "tests" / "support" / "workers" / "gloo_faults.py")
HANG_TIMEOUT = 3.0

# fault -> the headline's start (after "cause: "), culprit first.
HEADLINES = {
    "skip": "rank 1 (node1) never entered all_reduce #3 on group2[1] (float32, 1.0 KiB), which "
            "rank 0 (node1) waits in",
    "mismatch": "rank 2 (node2) entered all_gather #3 on world where the other members entered "
                "all_reduce #3 on world (float32, 1.0 KiB), which ranks 0, 1 (node1), 3 (node2) "
                "wait in (a mismatch",
    "stop": "rank 3 (node2) is stopped (SIGSTOP/SIGTSTP)",
    # Its process stays in torch's teardown (gloo's pairs wait for the peers that still run),
    # so the others never see a closed connection: they wait, and the shim's marker tells.
    "early": "rank 3 (node2) has returned from its main while the others still communicate "
             "(its process has not ended: torch.distributed's teardown waits); ranks 0, 1 "
             "(node1), 2 (node2) wait for it in all_reduce #3 on world (float32, 1.0 KiB)",
}


@pytest.mark.parametrize("fault", sorted(HEADLINES))
def test_an_unmodified_gloo_program_gets_the_culprit_first_within_the_hang_timeout(
        fault, cluster, tmp_path):
    res = run_dtrain(["launch", "-H", "node1:2,node2:2", "--ssh-config", str(cluster.ssh_config),
                      "--hang-timeout", str(HANG_TIMEOUT), "--hang-action", "abort", "--grace",
                      "1", "--log-dir", str(tmp_path), "--", PYTHON, WORKER, fault], timeout=240)
    assert res.returncode == 123, res.stderr[-3000:]
    (path,) = tmp_path.glob("*/hang-1.txt")
    first = path.read_text().splitlines()[0]
    assert "cause: " + HEADLINES[fault] in first, first
    stalled = float(re.search(r"no rank made progress for ([\d.]+)s", first)[1])
    assert stalled < HANG_TIMEOUT + 3, first
    assert "stack of rank" in path.read_text()
    assert not cluster.wait_no_job_pids(timeout=30)


def _args(cluster, log_dir) -> list[str]:
    return ["launch", "-H", "node1:2,node2:2", "--ssh-config", str(cluster.ssh_config),
            "--hang-timeout", str(HANG_TIMEOUT), "--hang-action", "abort", "--grace", "1",
            "--log-dir", str(log_dir)]


def test_a_gloo_rank_stalled_inside_a_send_is_named_first_with_its_peer(cluster, tmp_path):
    """Rank 2 (node2) sends 4 MiB to rank 0 (node1) each step, the last one after the test
    made node2's packets to node1 vanish (node1's address resolves to a hardware address
    nobody has): both halves are posted, nothing arrives, ranks 1 and 3 wait in the world's
    all-reduce. gloo's Flight Recorder holds no send; the shim's wrapper of the process
    group's send and recv does."""
    ready, go, logs = tmp_path / "ready", tmp_path / "go", tmp_path / "logs"
    ns, node1 = cluster.namespace("node2"), cluster.address("node1")
    code, err = run_with_link_cut([*_args(cluster, logs), "--", PYTHON, WORKER, "send",
                                   str(ready), str(go)],
                                  ns=ns, peer=node1, ready=ready, go=go, timeout=180)
    assert code == 123, err[-3000:]
    (path,) = logs.glob("*/hang-1.txt")
    text = path.read_text()
    first = text.splitlines()[0]
    # World operations: a send or receive and an all-reduce per step for ranks 0 and 2, so the
    # third step's send is #5; ranks 1 and 3 wait in their third all-reduce.
    assert ("cause: rank 2 (node2) is stalled inside send #5 on world (float32, 4.0 MiB) to "
            "rank 0 (node1), which waits in recv #5 on world for it: the posted send never "
            "arrives (its host's network, or the transport under it, does not deliver); ranks "
            "1 (node1), 3 (node2) wait for it too") in first, text
    stalled = float(re.search(r"no rank made progress for ([\d.]+)s", first)[1])
    assert stalled < HANG_TIMEOUT + 3, first
    assert "stack of rank 2" in text and "send_stall (gloo_faults.py" in text, text
    assert not cluster.wait_no_job_pids(timeout=30)


def test_a_healthy_all_reduce_longer_than_the_hang_timeout_is_no_hang(tmp_path):
    """One all-reduce sized to take 6 hang timeouts on this machine: the ranks inside it use
    their CPU (gloo moves and reduces the data), so the job ends normally. Its size is capped
    (2 GiB a rank), so on a fast idle machine it may take fewer timeouts: 2 GiB took 3.6 s on
    this one; it must outlast one."""
    res = run_dtrain(["launch", "--nproc-per-node", "4", "--hang-timeout", "1",
                      "--hang-action", "abort", "--log-dir", str(tmp_path), "--", PYTHON, WORKER,
                      "long", "6"], timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    took = [float(m) for m in re.findall(r"all_reduce ([\d.]+) s", res.stdout)]
    assert len(took) == 4 and min(took) > 1, res.stdout  # it did outlast the timeout
    assert not list(tmp_path.rglob("hang-*.txt")) and "hang" not in res.stderr


def test_the_recorder_is_turned_on_unless_the_user_set_it_and_the_shim_leads_the_path():
    env = flight.rank_env({"PYTHONPATH": "/mine"}, "/f/rank-0.progress", 0.6)
    assert env == {flight.FILE: "/f/rank-0.progress.flight.json", flight.INTERVAL: "0.3",
                   "PYTHONPATH": f"{flight.SHIM}:/mine", flight.BUFFER: "256"}
    assert flight.BUFFER not in flight.rank_env({"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}, "/f", 1)


def test_the_shims_file_becomes_the_ranks_record_and_anything_else_is_none(tmp_path):
    body = {"pid": 7, "rank": 2, "groups": [{
        "label": "world", "group_rank": 2, "group_size": 4, "seq": 3, "done": 2,
        "op": "all_reduce", "dtype": "float32", "p2p": 0, "peer": -1, "nbytes": 1024,
        "entered_at": 5.0, "history": [[2, "all_reduce", -1, 2], [3, "all_reduce", -1, 3]]}]}
    good = tmp_path / "a.flight.json"
    good.write_text(json.dumps(body))
    record = flight.read(str(good))
    assert record is not None and record.pid == 7 and record.groups[0].done == 2
    assert record.groups[0].history[-1] == (3, "all_reduce", -1, 3)
    assert flight.recorder(record) == "flight" and flight.recorder(None) == ""
    good.write_text(json.dumps({**body, "spins": True}))  # NCCL: its waiting ranks spin
    assert flight.recorder(flight.read(str(good))) == "flight-spin"
    bad = tmp_path / "b.flight.json"
    bad.write_text(json.dumps({**body, "groups": [{"label": "world"}]}))
    assert flight.read(str(bad)) is None and flight.read(str(tmp_path / "none")) is None

