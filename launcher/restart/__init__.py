"""Restart rounds: after a failure the job starts again, on healthy or spare hosts (issue 29).

    policy    which failures restart, the budget (--max-restarts), the growing back-off (pure)
    blame     the hosts a failure names, and which of them must leave the job (pure)
    pool      active hosts, spares, exclusion, --min-nodes: the hosts of the next round (pure)
    goodput   per-round timings, steps repeated, the goodput table and its JSON (pure)
    rounds    the job as rounds of the head's supervisor over agents that stay connected

See docs/design.md §8.
"""
