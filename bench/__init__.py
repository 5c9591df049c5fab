"""Benchmarks: `make bench` runs them side by side with the peer tools (docs/design.md 5)."""
