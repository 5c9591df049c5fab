"""dtrain's head-node launcher: start every rank on every host, leave nothing behind.

Module map: the launch in the order it happens. Dependencies flow downwards only; sockets,
paramiko and subprocess live in the modules marked (adapter). `tests/project/test_layers.py` checks
that subpackages import each other without a cycle, that no module is over 400 lines, and that
launcher/ and trainer/ never import each other.

    cli          click commands `launch`, `check`, `agent`: parse, delegate, map errors (adapter)
    launch       one launch from request to exit code: hosts -> plan -> agents -> rounds
    hosts/       hostfile      hostfile and -H parsing, host name validation (pure)
                 names         host and user names dtrain accepts (pure)
                 selection     --include/--exclude/--num-nodes, slots per host (pure)
    plan/        job           global/node/local ranks and each rank's environment (pure)
                 environment   forwarded variables, .dtrainenv, --env, scrubbing (pure)
    transport/   table         every transport in one table: --launcher and --ssh-client rows,
                               the entry each starts with (imported only when used)
                 stream        the AgentStream protocol every transport implements
                 pump          one reader thread for many pollable streams: the head's, a
                               relay's to its children (adapter)
                 connect       open one agent stream per host by its row, in parallel
                 options       SSHOptions, built by the CLI without importing paramiko
                 local         the agent as a local subprocess (adapter)
                 ssh           paramiko connection and agent channel (adapter)
                 openssh/      --ssh-client openssh: session (one system `ssh` per host, its
                               errors; adapter), config (`ssh -G` per host and jump hop,
                               refused as for paramiko)
                 ssh_config    ~/.ssh/config resolution
                 ssh_config_refusal  reading the config as ssh does; refusing what runs code
                 ssh_sockets   TCP within ConnectTimeout, ProxyJump tunnels (adapter)
                 ssh_auth      host-key check and public-key authentication (adapter)
                 host_keys     known_hosts policy: verify, accept-new, revoked/changed keys
    slurm/       nodelist      SLURM_JOB_NODELIST expansion, as `scontrol show hostnames` (pure)
                 allocation    hosts, slots and GPU ids from SLURM_* with their source (pure)
                 srun          --launcher slurm: each agent as one srun step (adapter)
    head/        startup       SPEC to all at once, HELLO + READY back, START on all or none
                 early         each SPEC as its stream opens, heartbeats while others open
                 supervisor    one job or round: fail-fast, Ctrl-C, timeout, heartbeats, PMI
                 pmi_notes     the PMI relay; refused MPI features and stalled barriers
                 agent_link    the head's end of one agent stream: frame routing and sender;
                               the Fleet of a job's links across its rounds
                 options       heartbeats, grace, timeouts, PMI: how the head supervises
                 stdin         the head's stdin to rank 0, credit flow control
                 outcome       per-rank states and the exit-code rule
                 report        the final per-rank exit table
                 progress      --hang-timeout/--hang-action, --status-interval, stragglers
    restart/     rounds after failures (--max-restarts):
                 policy        which failures restart, the budget, the back-off (pure)
                 blame         the hosts a failure names, those that must leave (pure)
                 pool          active hosts, spares, exclusion, --min-nodes (pure)
                 goodput       per-round timings, steps repeated, goodput (pure)
                 rounds        the job as supervisor rounds over agents that stay connected
                 vetting       the next round's hosts reachable and checked (reconnect, probes)
                 flags         the click options of restarts (adapter)
    output/      writer        the output writer thread and its byte-bounded queue
                 sink          [rank@host] prefixes, raw passthrough, per-rank log files
                 lines         linear line splitting with a 1 MiB line cap (pure)
    rendezvous/  agents started elsewhere join the head (`dtrain agent --rendezvous`):
                 options       the head's and the agent's settings, the token file (pure)
                 tokens        the accepted token form, `dtrain token new`
                 handshake     challenge and response over the shared token (pure)
                 clear, strangers   unproved frames bounded; their few lines (pure)
                 channel       the sealed records after the handshake (pure)
                 roster        who joined, their order, who is refused; the restart hook (pure)
                 stream, gate, listener, join   the sockets of both sides (adapters)
                 head          the table's rendezvous entry: wait for N agents, place them
                 command       the click options of both sides (adapter)
    agent/       the per-host agent, run on each host as `python -m launcher.agent`
                 serve         the process around the loop: signals, subreaper, exit
                 main          the agent's event loop: spec check, start, relay, stop
                 head_link     the agent's end of the stream to the head
                 writer        one thread writes every frame; rank output back-pressured
                 stdin         rank 0's stdin, written by a thread of its own
                 host          the agent's hands on its host: start a rank, read /proc, the
                               records' folder, strays (adapter; the simulator passes its own)
                 ranks         rank processes: own process group, parent-death signal (adapter)
                 descendants   subreaper; stray descendants (setsid) stopped with the job
                 pmi_sockets   PMI_FD / PMI_PORT sockets for the host's ranks (adapter)
                 leftovers     what a job leaves in /dev/shm; a dead agent's, removed by the
                               next agent on the host (adapter)
                 facts         what the agent reports about its host (dtrain check)
                 progress      the ranks' progress records: folder, reading, py-spy stacks
                               (the folder holds each rank's error file too)
                 flight        torch.distributed programs: the Flight Recorder turned on and
                               read by flight_shim/sitecustomize in each rank, which also
                               notes send/recv and a rank leaving its main (no record of
                               their own needed)
    tree/        --fanout K: shape (who starts whom, pure), fence (a relay's merged PMI fence,
                 pure), hops (what the head hands a relay per host), relay (the agent's relay,
                 adapter), head (one real stream per host the head starts, a RelayedStream
                 per host below it, adapter)
    hang/        views, model, causes, cycles, graph, diagnose: who caused a hang (the
                 Diagnosis the restart logic reads); watch, status: stragglers, live table (pure)
    pmi/         PMI-1 codec, per-host proxy core and the actions it asks for, the head's
                 key-value space, the stall clock (pure)
    check        the preflight table (`dtrain check`)
    perf         `dtrain check --perf`: matmul per host, all-reduce per host pair
    dryrun       the --dry-run table: hosts, ranks, environments, the program each runs
    mpirun/      command       --launcher mpirun: the same plan as an mpiexec/mpirun command
                 job           the table's mpirun entry: build, print or run the command
                 rankshim      each rank under it: contract, interfaces, abort on failure
    wire         head <-> agent frames, and the typed SPEC whose defaults are the only ones (pure)
    netroute     which local address and interface reach a given host
    errorfile    a failed rank's root cause from its TORCHELASTIC_ERROR_FILE (pure)
    errors       the exception hierarchy

Design notes the code relies on: docs/design.md.
"""

import time as _time

__version__ = "0.1.0"

#: When the launcher was first imported: the origin of `dtrain launch --timings`.
STARTED = _time.monotonic()
