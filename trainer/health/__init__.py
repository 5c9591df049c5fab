"""Is the cluster healthy and evenly fast? Rank-side probes run by `dtrain check --perf`."""
