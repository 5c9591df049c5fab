"""Which hosts and slots a job runs on: hostfile and `-H` parsing, `--include/--exclude`."""
