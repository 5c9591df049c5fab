"""The `dtrain` command: `dtrain launch [OPTIONS] -- PROGRAM ARGS...` and `dtrain check`.

    dtrain launch --hostfile hostfiles/cluster -- python -m trainer.train --dp 2 --tp 2 --pp 2
    dtrain launch --nproc-per-node 4 -- python train.py        # localhost, no sshd needed
    dtrain check --hostfile hostfiles/cluster
"""

from __future__ import annotations

import faulthandler
import functools
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from launcher import __version__
from launcher.errors import DtrainError
from launcher.head.options import SuperviseOptions
from launcher.launch import HostRequest, LaunchRequest, run_launch
from launcher.rendezvous import command as rendezvous
from launcher.restart import flags as restart_flags
from launcher.transport import table
from launcher.transport.options import SSHOptions

#: `--help` sections: option destination -> section title, in the order sections are shown.
HELP_SECTIONS: dict[str, tuple[str, ...]] = {
    "Hosts and slots": ("hostfile", "hosts", "include", "exclude", "num_nodes",
                        "nproc_per_node"),
    "SSH": ("ssh_config", "known_hosts", "ssh_accept_new", "ssh_connect_timeout",
            "ssh_allow_config_exec", "ssh_client", "remote_python", "fanout"),
    "Environment": ("env", "master_addr", "master_port", "chdir"),
    "Output": ("no_prefix", "raw", "log_dir", "timings", "dry_run", "status_interval"),
    "Failure handling": ("start", "timeout", "grace", "heartbeat_interval", "launch_timeout",
                         "hang_timeout", "hang_action"),
    "Restarts": restart_flags.NAMES,
    "MPI": ("pmi", "pmi_stall", "launcher_kind", "mpirun_path", "mpi_flavour"),
    "Rendezvous (agents started elsewhere join)": rendezvous.HEAD_OPTIONS,
}
#: The defaults the options show: each is written once, in its dataclass.
SUPERVISE, SSH, LAUNCH = SuperviseOptions(), SSHOptions(), LaunchRequest(argv=())
FORGOT_DASHES = ("If it belongs to your program, put `--` before the program: "
                 "dtrain launch [OPTIONS] -- PROGRAM [ARGS]...")


class SectionedCommand(click.Command):
    """A command whose --help lists its options in `HELP_SECTIONS` (click's own formatter)."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            row = param.get_help_record(ctx) if isinstance(param, click.Option) else None
            if row is not None:
                title = next((t for t, names in HELP_SECTIONS.items() if param.name in names),
                             "Other")
                rows.setdefault(title, []).append(row)
        for title in [*HELP_SECTIONS, "Other"]:
            if title in rows:
                with formatter.section(title):
                    formatter.write_dl(rows[title])

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            # Options after the program are the program's; one before it may be too.
            raise click.NoSuchOption(exc.option_name, f"{exc.message.rstrip('.')}. "
                                     f"{FORGOT_DASHES}", exc.possibilities, exc.ctx) from None


def host_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Options that choose hosts and slots, shared by launch and check."""
    opts = [
        click.option("--hostfile", "-f", type=click.Path(dir_okay=False),
                     help="Hostfile (DeepSpeed `host slots=N`, Open MPI or MPICH `host:N` form)."),
        click.option("-H", "--hosts", help="Inline host list, e.g. node1:4,node2:4."),
        click.option("--include", "-i", help="Hosts/slots to use, e.g. node1:0,1@node2."),
        click.option("--exclude", "-e", help="Hosts/slots to leave out, same syntax."),
        click.option("--num-nodes", type=click.IntRange(min=1), help="Use the first N hosts."),
        click.option("--nproc-per-node", type=click.IntRange(min=1),
                     help="Ranks per host. Without --hostfile/-H: ranks on localhost (default "
                     "1). With them: the first N slots of every host; it wins over slots=, "
                     "with a warning when they differ, and may not exceed it."),
        click.option("--ssh-config", type=click.Path(dir_okay=False),
                     help="ssh_config file (default ~/.ssh/config)."),
        click.option("--known-hosts", type=click.Path(dir_okay=False),
                     help="known_hosts file (default from ssh_config or ~/.ssh/known_hosts)."),
        click.option("--ssh-accept-new", is_flag=True,
                     help="Trust and record unknown host keys (changed keys are always refused)."),
        click.option("--ssh-connect-timeout", type=float, default=SSH.connect_timeout,
                     show_default=True,
                     help="Seconds to wait for each host's TCP connection."),
        click.option("--ssh-allow-config-exec", is_flag=True,
                     help="Let ssh_config ProxyCommand / Match exec run (refused by default)."),
    ]
    return functools.reduce(lambda f, opt: opt(f), reversed(opts), fn)


def _host_request(kw: dict[str, Any]) -> HostRequest:
    return HostRequest(hostfile=kw.pop("hostfile"), hosts=kw.pop("hosts"),
                       include=kw.pop("include"), exclude=kw.pop("exclude"),
                       num_nodes=kw.pop("num_nodes"), nproc_per_node=kw.pop("nproc_per_node"))


def _ssh_options(kw: dict[str, Any]) -> SSHOptions:
    config, known = kw.pop("ssh_config"), kw.pop("known_hosts")
    return SSHOptions(client=kw.pop("ssh_client", SSH.client),
                      config_file=Path(config) if config else None,
                      known_hosts=Path(known) if known else None,
                      accept_new=kw.pop("ssh_accept_new"),
                      connect_timeout=kw.pop("ssh_connect_timeout"),
                      allow_config_exec=kw.pop("ssh_allow_config_exec"))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dtrain")
def main() -> None:
    """Start and supervise distributed training jobs on bare-metal clusters."""
    # `kill -USR1 <dtrain pid>` prints every thread's stack: the first thing to ask for
    # when a launch looks stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)


LAUNCH_EXAMPLES = """Examples:

\b
  dtrain launch --nproc-per-node 4 -- python train.py
  dtrain launch --hostfile hosts -- python -m trainer.train --dp 2 --tp 2 --pp 2
  dtrain launch -H node1:4,node2:4 --exclude node2:3 --log-dir logs -- python train.py
  dtrain launch --hostfile hosts --dry-run -- python train.py
  dtrain launch --hostfile hosts --launcher mpirun -- python mpi_prog.py
  dtrain launch --rendezvous-port 29400 --nnodes 4 --token-file token -- python train.py

Everything from PROGRAM on is passed to it unchanged, so `--` is only needed before a program
whose name starts with a dash; it is always safe."""


# Options end at the first argument that is not one (allow_interspersed_args): the program's
# own options, e.g. `-m` of `python -m pkg` or a `--timeout` of its own, are never dtrain's.
@main.command(cls=SectionedCommand, epilog=LAUNCH_EXAMPLES,
              context_settings={"ignore_unknown_options": False,
                                "allow_interspersed_args": False})
@host_options
@rendezvous.head_options
@click.option("--env", "env", multiple=True, metavar="K=V", help="Extra variable for every rank.")
@click.option("--master-addr", help="Rendezvous address (default: rank 0's routable address).")
@click.option("--master-port", type=click.IntRange(1, 65535),
              help="Rendezvous port (default: a free port on rank 0's host).")
@click.option("--chdir", type=click.Path(file_okay=False),
              help="Working directory of the ranks (default: the current one, on every host).")
@click.option("--remote-python", default=LAUNCH.remote_python,
              show_default="the head's own interpreter, sys.executable",
              help="Interpreter that runs the agent on every host.")
@click.option("--ssh-client", type=click.Choice(table.SSH_CLIENTS), default=SSH.client,
              show_default=True, help=table.helps(table.SSH_CLIENTS) + ".")
@click.option("--fanout", type=click.IntRange(min=0), metavar="K",
              help="Start agents through a tree of hosts: the head starts K, each of those "
              "up to K more, and so on; 0: the head starts every host (flat). Default: flat "
              "up to 64 hosts, else 32 (docs: Launching).")
@click.option("--no-prefix", is_flag=True, help="Do not prefix output lines with [rank@host].")
@click.option("--raw", is_flag=True, help="Pass output through unchanged (progress bars).")
@click.option("--log-dir", type=click.Path(file_okay=False), metavar="DIR",
              help="Also write DIR/<job id>/rank-N.log files (a new folder per run).")
@click.option("--start", type=click.Choice(["together", "eager"]), default=SUPERVISE.start,
              show_default=True,
              help="together: no rank starts until every host has checked the job, so a bad "
              "host starts nothing anywhere; eager: each host starts its ranks as soon as it "
              "and rank 0's host have checked it (sooner on large clusters; a host that "
              "refuses then stops the ranks already running) (docs: Launching).")
@click.option("--timeout", type=float, help="Stop the job after this many seconds (exit 124).")
@click.option("--grace", type=float, default=SUPERVISE.grace, show_default=True,
              help="Seconds between SIGTERM and SIGKILL when stopping ranks.")
@click.option("--heartbeat-interval", type=click.FloatRange(min=0.05),
              default=SUPERVISE.heartbeat, show_default=True,
              help=f"Seconds between heartbeats (a host is lost after {SUPERVISE.misses} misses).")
@click.option("--launch-timeout", type=float, default=SUPERVISE.launch_timeout, show_default=True,
              help="Seconds from connecting to every rank running.")
@click.option("--hang-timeout", type=click.FloatRange(min=0), default=SUPERVISE.hang_timeout,
              show_default=True,
              help="Diagnose a hang when no rank advanced for this many seconds while ranks "
              "wait in a communication operation (0: never); the culprit rank is named first. "
              "Seen for dtrain's trainer (trainer.comm), any torch.distributed program, gloo "
              "or NCCL (torch's Flight Recorder for the collectives of every group, and "
              "dtrain's shim for send/recv), and MPI programs (a rank in MPI_Finalize while "
              "the others wait in an MPI call); a program using none of these gets the ranks' "
              "stacks once every rank sat idle this long (docs: Hangs).")
@click.option("--hang-action", type=click.Choice(["report", "abort"]),
              default=SUPERVISE.hang_action,
              show_default=True, help="After a hang diagnosis: keep waiting, or stop the job "
              "(exit 123).")
@click.option("--status-interval", type=click.FloatRange(min=0), default=SUPERVISE.status_interval,
              help="Print every rank's step, last operation and step time this often (seconds).")
@restart_flags.restart_flags
@click.option("--pmi", type=click.Choice(["fd", "port", "off"]), default=SUPERVISE.pmi,
              show_default=True,
              help="How MPI ranks reach the PMI-1 server of their agent.")
@click.option("--pmi-stall", type=click.FloatRange(min=0.1), default=SUPERVISE.pmi_stall,
              show_default=True,
              help="Seconds after which a waiting PMI barrier names the ranks it waits for.")
@click.option("--launcher", "launcher_kind", type=click.Choice(table.launchers()),
              default=LAUNCH.launcher, show_default=True,
              help=table.helps(table.launchers()) + ".")
@click.option("--mpirun", "mpirun_path", help="mpiexec/mpirun to use with --launcher mpirun.")
@click.option("--mpi-flavour", type=click.Choice(["hydra", "openmpi"]),
              help="Kind of --mpirun (detected from its --version by default).")
@click.option("--dry-run", is_flag=True, help="Print hosts, ranks and environments; start nothing.")
@click.option("--timings", is_flag=True,
              help="Print when connecting, agents, ranks and exit completed, and the slowest "
                   "agent's own start-up phases.")
@click.argument("program", nargs=-1, required=True, type=click.UNPROCESSED,
                metavar="[--] PROGRAM [ARGS]...")
def launch(program: tuple[str, ...], **kw: Any) -> None:
    """Start PROGRAM once per slot on every host and supervise it to the end.

    Exit code: 0 when every rank exits 0; otherwise the first failing rank's code (128+N for
    signal N), the MPI_Abort code, 124 for --timeout, 130 for Ctrl-C, 255 for a lost host,
    123 for a hang under --hang-action abort; after restarts (--max-restarts), the last
    round's.
    """
    _leave(_guard(lambda: run_launch(_launch_request(program, kw))))


def _leave(code: int) -> None:
    """End the head with ``code`` at once, without Python's own finalization, once the job
    is over and no other thread of ours runs: by then every stream, connection and log file is
    closed and the report is written, and that finalization (tearing down every module and
    object the launch built, with no system call to wait for) took 0.2-0.4 s of a loaded
    machine after the last rank ended: more than half of the exit tail on 16 namespace hosts
    (`bench.hosts_scale`; Hydra's mpiexec, a C program, has none). A thread still running
    (not a daemon) gets the ordinary exit, which waits for it."""
    import threading

    if any(t.is_alive() and not t.daemon for t in threading.enumerate()
           if t is not threading.main_thread()):
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone, or closed: nothing more can be said
            pass
    # Children that ended unwaited (an agent killed under us) are reaped here, as finalizing
    # their Popen objects would: else each stays a zombie wherever PID 1 does not reap, and
    # looks alive to the next agent judging what it left (`launcher.agent.leftovers`).
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:  # no child left
        pass
    os._exit(code)


def _launch_request(program: tuple[str, ...], kw: dict[str, Any]) -> LaunchRequest:
    hosts = _host_request(kw)
    ssh = _ssh_options(kw)
    kind, joining = rendezvous.head_request(kw, kw["launcher_kind"], hosts_given=bool(
        hosts.hostfile or hosts.hosts or hosts.num_nodes))
    return LaunchRequest(
        argv=program, hosts=hosts, cwd=os.path.abspath(kw["chdir"] or os.getcwd()),
        env=kw["env"], master_addr=kw["master_addr"], master_port=kw["master_port"], ssh=ssh,
        remote_python=kw["remote_python"], fanout=kw["fanout"], prefix=not kw["no_prefix"],
        raw=kw["raw"],
        log_dir=Path(kw["log_dir"]) if kw["log_dir"] else None, dry_run=kw["dry_run"],
        timings=kw["timings"],
        supervise=SuperviseOptions(heartbeat=kw["heartbeat_interval"], grace=kw["grace"],
                                   timeout=kw["timeout"], launch_timeout=kw["launch_timeout"],
                                   pmi=kw["pmi"], pmi_stall=kw["pmi_stall"],
                                   hang_timeout=kw["hang_timeout"],
                                   hang_action=kw["hang_action"],
                                   status_interval=kw["status_interval"],
                                   start=kw["start"]),
        launcher=kind, mpirun=kw["mpirun_path"], mpi_flavour=kw["mpi_flavour"],
        rendezvous=joining,
        restart=restart_flags.restart_options(kw),
    )


def _guard(action: Callable[[], int]) -> int:
    """Run a command; a DtrainError becomes its message and exit code, Ctrl-C becomes 130."""
    try:
        return action()
    except DtrainError as exc:
        click.echo(f"dtrain: error: {exc}", err=True)
        return exc.exit_code
    except KeyboardInterrupt:
        click.echo("dtrain: interrupted before the job started; nothing is running", err=True)
        return 130


@main.command()
@rendezvous.agent_options
def agent(**kw: Any) -> None:
    """Join the head at HOST:PORT and run this node's ranks (rendezvous mode).

    What Kubernetes, a batch script or an instance group runs on every node, with the token
    file the head has (`dtrain token new > FILE` makes one). Exit code: 0 when every rank here
    exited 0; non-zero when refused (late, excluded), when no head accepted its token before
    --join-timeout, when the head went away, or a rank failed.
    """
    from launcher.rendezvous.join import run_agent

    sys.exit(_guard(lambda: run_agent(rendezvous.join_request(kw))))


main.add_command(rendezvous.token_group)


@main.command(cls=SectionedCommand)
@host_options
@click.option("--remote-python", default=LAUNCH.remote_python,
              show_default="the head's own interpreter, sys.executable",
              help="Interpreter that runs the agent on every host.")
@click.option("--chdir", type=click.Path(file_okay=False),
              help="Working directory to look for (default: the current one).")
@click.option("--launcher", "launcher_kind", type=click.Choice(table.launchers(checks=True)),
              default=LAUNCH.launcher, show_default=True,
              help=table.helps(table.launchers(checks=True)) + ".")
@click.option("--perf", is_flag=True, help="Then time a matmul on every host and an all-reduce "
              "between every pair of hosts, and flag the slow ones.")
def check(**kw: Any) -> None:
    """Preflight every host in parallel: SSH, versions, GPUs, working directory."""
    from launcher.check import run_check
    from launcher.launch import select
    from launcher.transport.connect import validate_remote_python

    hosts = _host_request(kw)
    ssh = _ssh_options(kw)
    cwd = os.path.abspath(kw["chdir"] or os.getcwd())

    def checks() -> int:
        python = validate_remote_python(kw["remote_python"])
        code = run_check(select(hosts), ssh=ssh, python=python, cwd=cwd,
                         via=table.get(kw["launcher_kind"]))
        if kw["perf"] and code == 0:
            from launcher.perf import run_perf

            code = run_perf(hosts, ssh, python, cwd)
        return code

    sys.exit(_guard(checks))
