"""Why a job is stuck, and who is slow: pure cores over the ranks' progress records.

    views      what the agents send about each rank: its groups' operations, step, state
    mpi        an MPI program without records: MPI_Finalize seen by PMI, MPI calls in stacks
    model      what the members of a group must agree on; the record of a blamed rank (Cause)
    causes     which ranks the job waits for, and which are causes rather than consequences
    cycles     cycles of waits with no cause: which rank broke the program
    graph      who waits for whom: reachability and strongly connected components
    diagnose   the Diagnosis: the root cause as data, and the text (headline first)
    watch      when a job counts as hung; which ranks are stragglers
    status     the live table of `dtrain launch --status-interval`

The records themselves are written by the ranks (`trainer.comm.progress`, layout in
`workerenv`) and read by the agents (`launcher.agent.progress`); the head acts on them
(`launcher.head.progress`, whose `ProgressMonitor.tick` returns each new `Diagnosis`).

For the restart logic, `launcher.hang.diagnose.Diagnosis` is the contract (frozen):

    kind           the headline cause: "past" (a member went on past an operation the others
                   wait in), "mismatch" (it waits at the same point in another operation),
                   "behind" (it never entered it: computing, blocked outside communication, or
                   it skipped one), "unsent" (a running sender whose posted send never
                   reaches the receiver waiting for it), "stopped", "exited", "finalizing"
                   (an MPI rank in MPI_Finalize while others wait: `hang.mpi`), "no-record",
                   "deadlock" (a cycle of waits nothing explains: every rank in it is
                   blamed), or "stalled" (every
                   member entered and it does not complete: a network or device problem, no
                   rank blamed)
    culprit_ranks  every rank blamed, the headline's first; () when none is
    blamed_hosts   their hosts (as in the hostfile), each once, in the same order: the hosts
                   to replace; waiting ranks' hosts are never in it
    group, op, seq the operation the headline names ("", "", 0 when none does)
    headline       one line for people; `lines` and `text` hold the rest
    causes         one `launcher.hang.model.Cause` per blamed rank, for finer decisions
"""
