"""The ranks' output on the head: whole lines, prefixed or raw, written by one thread.

* `launcher.output.writer`  the output writer thread and its byte-bounded queue
* `launcher.output.sink`    ``[rank@host]`` prefixes, raw passthrough, per-rank log files
* `launcher.output.lines`   linear line splitting with a 1 MiB line cap (pure)
"""
