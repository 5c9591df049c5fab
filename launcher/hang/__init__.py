"""Why a job is stuck, and who is slow: pure cores over the ranks' progress records.

    views      what the agents send about each rank: its groups' operations, step, state
    diagnose   names the ranks, operation, sequence number and group a hang is stuck on
    watch      when a job counts as hung; which ranks are stragglers
    status     the live table of `dtrain launch --status-interval`

The records themselves are written by the ranks (`trainer.comm.progress`, layout in
`workerenv`) and read by the agents (`launcher.agent.progress`); the head acts on them
(`launcher.head.progress`).
"""
