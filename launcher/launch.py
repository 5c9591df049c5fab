"""`dtrain launch`: hosts -> connections -> agents -> supervised job -> exit report and code.

Everything that can be checked before a connection is checked first (hostfile, filters,
environment); every connection is made before any agent starts; every agent checks its part of
the job before any rank starts. The job runs as rounds (`launcher.restart.rounds`): one, or
with --max-restarts one more after each failure the policy restarts.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from launcher import STARTED, wire
from launcher.errors import ConnectError, UsageError, listed
from launcher.head.options import SuperviseOptions
from launcher.hosts import hostfile, selection
from launcher.plan import environment
from launcher.plan import job as planning
from launcher.rendezvous.options import RendezvousOptions
from launcher.restart.policy import RestartOptions
from launcher.restart.pool import split_spares
from launcher.slurm import allocation
from launcher.transport import table
from launcher.transport.connect import close_streams, open_streams, start_agents
from launcher.transport.options import SSHOptions
from launcher.transport.stream import AgentStream
from launcher.tree.shape import Tree, choose_fanout

if TYPE_CHECKING:  # imported for real while the agents boot (see run_launch)
    from launcher.restart.rounds import JobEnd


@dataclass(frozen=True)
class HostRequest:
    """Which hosts and slots: the options shared by `launch` and `check`."""

    hostfile: str | None = None
    hosts: str | None = None
    include: str | None = None
    exclude: str | None = None
    num_nodes: int | None = None
    nproc_per_node: int | None = None


@dataclass(frozen=True)
class LaunchRequest:
    argv: tuple[str, ...]
    hosts: HostRequest = HostRequest()
    cwd: str = field(default_factory=os.getcwd)
    env: tuple[str, ...] = ()
    master_addr: str | None = None
    master_port: int | None = None
    ssh: SSHOptions = SSHOptions()
    remote_python: str = sys.executable
    fanout: int | None = None            # --fanout: hosts each host starts; 0 flat; None auto
    prefix: bool = True
    raw: bool = False
    log_dir: Path | None = None
    dry_run: bool = False
    timings: bool = False                # print when each start-up phase completed
    supervise: SuperviseOptions = SuperviseOptions()
    launcher: str = table.DEFAULT_LAUNCHER  # a --launcher row of launcher.transport.table
    mpirun: str | None = None            # path of mpiexec/mpirun for --launcher mpirun
    mpi_flavour: str | None = None       # hydra or openmpi; detected when None
    rendezvous: RendezvousOptions | None = None  # --launcher rendezvous: port, nodes, token
    restart: RestartOptions = RestartOptions()  # --max-restarts, spares, --min-nodes


def select(req: HostRequest) -> list[selection.HostSlots]:
    if req.hostfile and req.hosts:
        raise UsageError("conflicting host options", "--hostfile/-H",
                         "both were given", "use one of them")
    alloc = None
    if req.hostfile:
        entries = hostfile.parse_hostfile(req.hostfile)
    elif req.hosts:
        entries = hostfile.parse_host_list(req.hosts)
    elif allocation.in_allocation(os.environ):  # inside salloc/sbatch: the allocation's nodes
        alloc = allocation.read_allocation(os.environ)
        entries = list(alloc.entries)
    else:
        entries = hostfile.local_hosts(req.nproc_per_node or 1)
    nproc = req.nproc_per_node if (req.hostfile or req.hosts or alloc) else None
    if nproc is not None:
        _warn_slots_differ(entries, nproc)
    selected = selection.select_hosts(entries, include=req.include, exclude=req.exclude,
                                      num_nodes=req.num_nodes, nproc_per_node=nproc)
    return allocation.with_gpu_ids(selected, alloc) if alloc else selected


def _warn_slots_differ(entries: Sequence[hostfile.HostEntry], nproc: int) -> None:
    """--nproc-per-node wins over slots= (the first N slots of every host); say so when they
    differ. A host with fewer slots than N is an error of its own (selection), not a warning."""
    more = [e for e in entries if e.slots > nproc]
    if more and all(e.slots >= nproc for e in entries):
        shown = listed([f"{e.name} slots={e.slots}" for e in more], 3)
        sys.stderr.write(f"dtrain: warning: --nproc-per-node {nproc} differs from the host "
                         f"list ({shown}) [{more[0].source or 'host list'}]: "
                         f"--nproc-per-node wins, using the first {nproc} slot(s) of every "
                         "host. Drop one of the two to silence this\n")


def run_launch(req: LaunchRequest) -> int:
    if not req.argv:
        raise UsageError("nothing to run", "launch", "no program after the options",
                         "add the command after `--`, e.g. `dtrain launch -- python train.py`")
    transport = table.get(req.launcher)
    if transport.flow is table.Flow.JOIN:
        return _run_joined(req, transport)
    active, spares = _split(req, select(req.hosts), transport)
    plan = _plan(req, active, _base_env(req))
    if transport.flow is table.Flow.COMMAND:
        if req.supervise.start == "eager":
            raise UsageError(f"--start eager is not supported with --launcher {transport.name}",
                             "--start", "the MPI launcher starts the ranks, not dtrain's agents "
                             "(Hydra's proxies start each host's ranks as they come up)",
                             "drop --start eager")
        code: int = transport.load()(req, plan, active)
        return code
    tree = _tree(req, active, transport)
    if req.dry_run:
        from launcher.dryrun import print_plan

        print_plan(plan, master=(req.master_addr, req.master_port), out=sys.stdout)
        if spares:
            print(f"spares: {', '.join(s.entry.name for s in spares)}")
        if tree is not None:
            print("\n".join(tree.describe([h.entry.name for h in active])))
        return 0
    log_dir = _log_dir(req.log_dir, plan.job_id)
    t0 = time.monotonic()
    early: set[int] = set()
    if tree is not None:
        from launcher.tree.head import open_tree

        streams = open_tree(active, tree, python=req.remote_python, ssh=req.ssh,
                            transport=transport)
    else:
        from launcher.head.early import EarlySpecs
        from launcher.head.startup import early_spec_for

        specs = EarlySpecs(len(active), early_spec_for(plan, _supervised(req),
                                                       (req.master_addr, req.master_port)),
                           req.supervise.heartbeat)
        try:
            streams = open_streams(active, python=req.remote_python, ssh=req.ssh,
                                   transport=transport, retry_for=req.supervise.launch_timeout,
                                   opened=specs.opened)
        finally:
            early = set(specs.stop())
    # Spares boot while the first round starts; one that cannot be reached is left out.
    extra = start_agents(spares, python=req.remote_python, ssh=req.ssh,
                         transport=transport) if spares else []
    return _supervise(req, transport, plan, [*active, *spares], [*streams, *extra], log_dir,
                      started=t0, early=early)


def _supervised(req: LaunchRequest) -> SuperviseOptions:
    """How the head supervises this launch's rounds (what their SPECs carry)."""
    return replace(req.supervise, rounds=req.restart.enabled)


def _tree(req: LaunchRequest, active: Sequence[selection.HostSlots],
          transport: table.Transport) -> Tree | None:
    """The fan-out of a launch whose transport has relays (`launcher.tree`), None for a flat
    one. Left to its default, a launch the tree cannot carry (a local host) is flat."""
    tree = Tree(len(active), choose_fanout(req.fanout, len(active)))
    if tree.flat:
        return None
    carried = bool(transport.relays) and (
        transport.name != table.DEFAULT_LAUNCHER or not any(h.entry.is_local for h in active))
    if req.fanout is None and not carried:
        return None
    if not transport.relays:
        relaying = ", ".join(t.name for t in table.TRANSPORTS if t.relays)
        raise UsageError(f"--fanout is for --launcher {relaying}", "--fanout",
                         f"--launcher {transport.name} starts its agents itself",
                         "drop --fanout")
    return tree


def _run_joined(req: LaunchRequest, transport: table.Transport) -> int:
    """The join flow: the hosts are the agents that joined (`launcher.rendezvous`)."""
    base_env = _base_env(req)  # a bad .dtrainenv or --env fails before any agent joins
    joined = transport.load()(req.rendezvous, include=req.hosts.include,
                              exclude=req.hosts.exclude, nproc_per_node=req.hosts.nproc_per_node,
                              heartbeat=req.supervise.heartbeat)
    try:
        plan = _plan(req, joined.selected, base_env)
        log_dir = None if req.dry_run else _log_dir(req.log_dir, plan.job_id)
    except BaseException as exc:
        joined.abandon(f"the head stopped before the start: {exc}")
        raise
    try:
        if req.dry_run:
            from launcher.dryrun import print_plan

            print_plan(plan, master=(req.master_addr, req.master_port), out=sys.stdout)
            for stream in joined.streams:  # nothing to run: the agents leave with 0
                stream.write(wire.encode(wire.Kind.BYE))
            close_streams(joined.streams)
            return 0
        return _supervise(req, transport, plan, joined.selected, joined.streams, log_dir,
                          started=time.monotonic())
    finally:
        joined.close("the job is over")


def _base_env(req: LaunchRequest) -> dict[str, str]:
    """The variables every rank gets; the head says once how many each env file gave."""
    return environment.compose_base_env(os.environ, cwd=req.cwd, cli_env=req.env,
                                        tell=lambda line: print(f"dtrain: {line}",
                                                                file=sys.stderr))


def _plan(req: LaunchRequest, selected: list[selection.HostSlots],
          base_env: dict[str, str]) -> planning.JobPlan:
    """The job's plan; a given --master-addr/--master-port is checked now, before anything
    connects."""
    plan = planning.make_plan(selected, argv=req.argv, cwd=req.cwd, job_id=planning.new_job_id(),
                              base_env=base_env, grace=req.supervise.grace,
                              restart=planning.RoundInfo(0, req.restart.max_restarts))
    planning.Rendezvous(req.master_addr or "127.0.0.1", req.master_port or 29500)
    return plan


def _split(req: LaunchRequest, selected: list[selection.HostSlots], transport: table.Transport
           ) -> tuple[list[selection.HostSlots], list[selection.HostSlots]]:
    """The hosts that run ranks, and the spares (`launcher.restart.pool`)."""
    opts = req.restart
    marked = [h.entry for h in selected if h.entry.spare]
    if not opts.enabled and (opts.spares or marked or opts.min_nodes is not None):
        where = marked[0].source if marked else ("--spares" if opts.spares else "--min-nodes")
        raise UsageError("spare hosts and --min-nodes need restarts", where or "hosts",
                         "they act only when a failed job starts again",
                         "Add --max-restarts N (N >= 1)")
    if opts.enabled and transport.flow is table.Flow.COMMAND:
        raise UsageError(f"restarts are not supported with --launcher {transport.name}",
                         "--max-restarts", "another launcher supervises the ranks there, not "
                         "dtrain's agents", "Use --launcher ssh or slurm, or drop --max-restarts")
    return split_spares(selected, opts.spares)


def _supervise(req: LaunchRequest, transport: table.Transport, plan: planning.JobPlan,
               hosts: Sequence[selection.HostSlots],
               started_agents: Sequence[AgentStream | ConnectError], log_dir: Path | None, *,
               started: float, early: Collection[int] = ()) -> int:
    """The job over the agents started on ``hosts`` (spares last), to its report and exit
    code; the hosts numbered in ``early`` were sent their SPEC as their streams opened."""
    connected = time.monotonic()
    # Imported while the agents boot on their hosts: off the critical path of a launch.
    from launcher.output.sink import OutputSink
    from launcher.restart.rounds import Rounds, RoundsSetup

    def sink_for(round_plan: planning.JobPlan, folder: Path | None) -> OutputSink:
        return OutputSink({r.rank: r.host for r in round_plan.ranks}, sys.stdout.buffer,
                          sys.stderr.buffer, prefix=req.prefix, raw=req.raw, log_dir=folder)

    def connect(chosen: Sequence[selection.HostSlots]) -> list[AgentStream | ConnectError]:
        if transport.flow is table.Flow.JOIN:  # the head cannot start an agent there
            return [ConnectError("agent gone", f"host {h.entry.name}", "it joined through "
                                 "the rendezvous and left", "start its agent again")
                    for h in chosen]
        return start_agents(chosen, python=req.remote_python, ssh=req.ssh, transport=transport)

    rounds = Rounds(RoundsSetup(
        argv=req.argv, cwd=req.cwd, job_id=plan.job_id, base_env=plan.base_env,
        supervise=_supervised(req), restart=req.restart,
        master=(req.master_addr, req.master_port), log_dir=log_dir, sink_for=sink_for,
        connect=connect), hosts[:len(plan.hosts)], hosts[len(plan.hosts):])
    rounds.adopt(hosts, started_agents, early)
    previous = {s: signal.signal(s, rounds.on_signal)
                for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        end = rounds.run(started)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        close_streams([link.stream for link in rounds.fleet.links])
    _print_end(req, transport, end, log_dir, started=started, connected=connected)
    return end.outcome.exit_code


def _print_end(req: LaunchRequest, transport: table.Transport, end: JobEnd,
               log_dir: Path | None, *, started: float, connected: float) -> None:
    """What the head prints once the job is over: the report, the stragglers, why the
    transport's own system ended the job (Slurm), with --max-restarts the rounds (and
    goodput.json), and with --timings where the start-up went."""
    from launcher.head.report import print_report  # rich: only once the job is over

    sup, outcome = end.last, end.outcome
    print_report(outcome, end.tail, time.monotonic() - started, sys.stderr)
    for line in sup.progress.final_report():
        sys.stderr.write(f"dtrain: {line}\n")
    if outcome.exit_code and (why := transport.explain_failure()):
        sys.stderr.write(f"dtrain: {why}\n")
    if req.restart.enabled:
        end.report(log_dir, sys.stderr)
    if req.timings:
        from launcher.head.startup import slowest_phases

        stamps = {"connected": connected, **sup.timings}
        sys.stderr.write("dtrain: timings since start: " + ", ".join(
            f"{k} {v - STARTED:.3f}s" for k, v in stamps.items() if v) + "\n")
        if phases := slowest_phases(sup.links):
            sys.stderr.write(f"dtrain: agents, slowest host per phase: {phases}\n")


def _log_dir(root: Path | None, job_id: str) -> Path | None:
    """``--log-dir`` keeps each run in its own folder, named by the job id (sorts by start
    time); made before anything connects, so an unusable folder stops nothing."""
    if root is None:
        return None
    folder = root / job_id
    try:
        folder.mkdir(parents=True)
    except OSError as exc:
        raise UsageError("cannot write the rank logs", f"--log-dir {root}",
                         exc.strerror or str(exc), "give a folder you can write to") from None
    sys.stderr.write(f"dtrain: rank logs in {folder}/\n")
    return folder
