"""dtrain's head-node launcher: start every rank on every host, leave nothing behind.

Module map (dependencies flow downwards only; sockets, paramiko and subprocess live in the
adapters named as such):

    cli             click commands: launch, check (adapter: terminal, signals)
    supervisor      runs a job: agents, fail-fast, Ctrl-C, timeout, exit report
    output          line splitting, [rank@host] prefixes, per-rank log files
    report          the final per-rank exit table
    mpirun          --launcher mpirun: the same plan as an mpiexec/mpirun command
    check           the preflight table (`dtrain check`)
    plan            global/node/local ranks and each rank's environment
    environment     forwarded variables, .dtrainenv, --env, scrubbing
    selection       --include/--exclude/--num-nodes
    hostfile        hostfile and -H parsing, host name validation
    ssh, hostkeys   paramiko connection, ~/.ssh/config, known_hosts policy (adapter)
    local           the agent as a local subprocess (adapter)
    transport       the AgentStream protocol both adapters implement
    agent           the per-host agent (runs on each host as `python -m launcher.agent`)
    pmi             PMI-1 codec, per-host proxy core and head key-value space
    wire            head <-> agent frames
    errors          the exception hierarchy
"""

import time as _time

__version__ = "0.1.0"

#: When the launcher was first imported: the origin of `dtrain launch --timings`.
STARTED = _time.monotonic()
