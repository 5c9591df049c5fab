"""Benchmarks: `make bench` runs them side by side with the peer tools (DESIGN.md section 5)."""
