"""dtrain as Kubernetes runs it: the example manifests (every one parses and names what dtrain
needs: commands that dtrain's own parser accepts, ports, variables, the token's mount), and an
MPIJob launcher whose workers resolve and accept SSH only after it started.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from launcher.cli import agent, launch
from launcher.errors import UsageError
from launcher.rendezvous import command as rendezvous_command
from launcher.rendezvous.options import read_token
from tests.support import PYTHON, REPO, dtrain_cmd, dtrain_env

EXAMPLES = REPO / "examples" / "kubernetes"
PROBE = str(REPO / "tests" / "support" / "workers" / "probe.py")
HOSTFILE = "/etc/mpi/hostfile"  # where mpi-operator mounts it (configMountPath + hostfileName)


def _objects() -> dict[str, dict[str, Any]]:
    """Every object of every example, by kind."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert {"apiVersion", "kind", "metadata"} <= doc.keys(), path
            found[doc["kind"]] = doc
    return found


def _containers(pod_template: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod_template["spec"]["containers"]}


def _options(command: Any, args: list[str]) -> dict[str, Any]:
    """What dtrain's own command line makes of ``args`` (parsed, nothing run)."""
    return dict(command.make_context(command.name, list(args)).params)


def test_the_examples_are_an_mpijob_and_a_rendezvous_jobset_with_its_secret_and_policy(
) -> None:
    assert {"MPIJob", "JobSet", "Secret", "NetworkPolicy"} <= set(_objects())


def test_the_example_secrets_placeholder_is_refused_until_a_real_token_replaces_it(
        tmp_path: Path) -> None:
    [placeholder] = _objects()["Secret"]["stringData"].values()
    token = tmp_path / "token"
    token.write_text(placeholder)
    token.chmod(0o400)
    with pytest.raises(UsageError, match="unusable token"):
        read_token(str(token))


def test_the_mpijob_launcher_runs_dtrain_on_the_operators_hostfile_and_the_workers_sshd(
) -> None:
    job = _objects()["MPIJob"]
    assert job["apiVersion"] == "kubeflow.org/v2beta1"
    specs = job["spec"]["mpiReplicaSpecs"]
    [launcher] = _containers(specs["Launcher"]["template"]).values()
    assert launcher["command"][:2] == ["dtrain", "launch"]
    opts = _options(launch, launcher["command"][2:])
    assert opts["hostfile"] == HOSTFILE
    assert opts["ssh_accept_new"] and opts["known_hosts"].startswith("/tmp/")  # writable
    assert opts["launch_timeout"] >= 120  # workers that come up late are waited for
    assert opts["program"][:3] == ("python", "-m", "trainer.train")
    [worker] = _containers(specs["Worker"]["template"]).values()
    assert worker["command"][0].endswith("sshd") and "-De" in worker["command"]
    assert job["spec"]["slotsPerWorker"] == worker["resources"]["limits"]["nvidia.com/gpu"]


def _volume_path(template: dict[str, Any], container: dict[str, Any], secret: str) -> str:
    """Where ``container`` sees the Secret ``secret``; its volume must be owner-only."""
    [volume] = [v for v in template["spec"]["volumes"]
                if v.get("secret", {}).get("secretName") == secret]
    assert volume["secret"]["defaultMode"] == 0o400  # dtrain refuses a token others can read
    [mount] = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    return str(mount["mountPath"])


def test_the_rendezvous_jobset_points_every_agent_at_the_heads_port_with_the_token(
        monkeypatch: pytest.MonkeyPatch) -> None:
    objects = _objects()
    secret, jobset = objects["Secret"], objects["JobSet"]
    [key] = secret["stringData"]
    jobs = {r["name"]: r for r in jobset["spec"]["replicatedJobs"]}
    head_template = jobs["head"]["template"]["spec"]["template"]
    [head] = _containers(head_template).values()
    assert head["command"][:2] == ["dtrain", "launch"]
    opts = _options(launch, head["command"][2:])
    token = f"{_volume_path(head_template, head, secret['metadata']['name'])}/{key}"
    assert opts["token_file"] == token
    assert {"containerPort": opts["rendezvous_port"], "name": "rendezvous"} in head["ports"]
    workers = jobs["workers"]["template"]["spec"]
    assert workers["parallelism"] == workers["completions"] == opts["nnodes"]
    assert workers["completionMode"] == "Indexed"  # the completion index is the node rank
    network = jobset["spec"]["network"]
    assert network["enableDNSHostnames"]
    # JobSet names a pod <jobset>-<replicated job>-<job index>-<pod index>.<subdomain>
    head_name = f"{jobset['metadata']['name']}-head-0-0.{network['subdomain']}"
    [worker] = _containers(workers["template"]).values()
    assert worker["command"] == ["dtrain", "agent"]
    env = {e["name"]: e.get("value") or e["valueFrom"]["fieldRef"]["fieldPath"]
           for e in worker["env"]}
    assert env["DTRAIN_RDZV_ENDPOINT"] == f"{head_name}:{opts['rendezvous_port']}"
    assert env["DTRAIN_RDZV_TOKEN_FILE"] == token
    assert _volume_path(workers["template"], worker, secret["metadata"]["name"]) == \
        token.rsplit("/", 1)[0]
    assert "job-completion-index" in env["DTRAIN_RDZV_NODE_RANK"]
    for name in ("DTRAIN_RDZV_ENDPOINT", "DTRAIN_RDZV_TOKEN_FILE", "DTRAIN_RDZV_TIMEOUT"):
        monkeypatch.setenv(name, env[name])
    monkeypatch.setenv("DTRAIN_RDZV_NODE_RANK", "3")  # what the annotation gives pod 3
    joins = rendezvous_command.join_request(_options(agent, []))
    assert (joins.host, joins.port, joins.node_rank) == (head_name, opts["rendezvous_port"], 3)
    assert joins.timeout == opts["rendezvous_timeout"]


JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"        # labels JobSet puts on the pods it makes
REPLICATED_JOB = "jobset.sigs.k8s.io/replicatedjob-name"


def test_a_network_policy_admits_only_the_jobs_own_worker_pods_to_the_rendezvous_port() -> None:
    objects = _objects()
    jobset, policy = objects["JobSet"], objects["NetworkPolicy"]
    assert policy["apiVersion"] == "networking.k8s.io/v1"
    name = jobset["metadata"]["name"]
    jobs = {r["name"]: r for r in jobset["spec"]["replicatedJobs"]}
    [head] = _containers(jobs["head"]["template"]["spec"]["template"]).values()
    port = _options(launch, head["command"][2:])["rendezvous_port"]
    [agents] = [job for job, spec in jobs.items()
                if _containers(spec["template"]["spec"]["template"]).popitem()[1]["command"]
                == ["dtrain", "agent"]]
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": {JOBSET_NAME: name, REPLICATED_JOB: "head"}}
    assert spec["policyTypes"] == ["Ingress"]  # the head pod takes nothing else
    [rule] = spec["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": {JOBSET_NAME: name,
                                                             REPLICATED_JOB: agents}}}]
    assert rule["ports"] == [{"protocol": "TCP", "port": port}]
    assert policy["metadata"].get("namespace") == jobset["metadata"].get("namespace")


def test_a_hostfile_whose_hosts_come_up_3s_after_the_launch_launches_without_error(
        bare_cluster, tmp_path: Path) -> None:
    """The MPIJob launcher pod starting first: its workers' names resolve (a private
    /etc/hosts for the head, filled in late) and their sshd listens only 3 s later."""
    cluster = bare_cluster
    names = {"node1": "dtrain-worker-0.dtrain-worker.default.svc",
             "node2": "dtrain-worker-1.dtrain-worker.default.svc"}
    hostfile = tmp_path / "hostfile"  # both forms mpi-operator writes: Open MPI's, MPICH's
    hostfile.write_text(f"{names['node1']} slots=2\n{names['node2']}:2\n")
    etc_hosts = tmp_path / "hosts"
    etc_hosts.write_text("127.0.0.1 localhost\n")
    config = tmp_path / "ssh_config"
    config.write_text(f"Host *.svc\n  User root\n  IdentityFile {cluster.client_key}\n"
                      "  IdentitiesOnly yes\n")
    launch_cmd = dtrain_cmd(["launch", "--hostfile", str(hostfile), "--ssh-config", str(config),
                             "--ssh-accept-new", "--known-hosts", str(tmp_path / "known_hosts"),
                             "--ssh-connect-timeout", "2", "--launch-timeout", "60", "--",
                             PYTHON, PROBE, "env"])
    head = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
         'mount --bind "$1" /etc/hosts && shift && exec "$@"', "sh", str(etc_hosts),
         *launch_cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env=dtrain_env())
    try:
        time.sleep(3)
        with etc_hosts.open("a") as hosts:  # in place: the bind mount shows this very file
            hosts.write("".join(f"{cluster.address(h)} {n}\n" for h, n in names.items()))
        for host in names:
            cluster.start_sshd(host)
        out, err = head.communicate(timeout=120)
    finally:
        head.kill()
        for host in names:
            cluster.kill_sshd(host)
    assert head.returncode == 0, err
    assert "not reachable yet: dtrain-worker-0" in err  # it was tried before the hosts were up
    ranks = {int(line[1:].split("@")[0]): json.loads(line.partition("] ")[2])
             for line in out.splitlines() if line.startswith("[")}
    assert [ranks[r]["DTRAIN_HOST"] for r in range(4)] == [names["node1"]] * 2 + [
        names["node2"]] * 2
    assert [ranks[r]["hostname"] for r in range(4)] == ["node1", "node1", "node2", "node2"]
    assert not cluster.wait_no_job_pids(10)
