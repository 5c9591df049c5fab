"""A distributed hello: each rank prints the worker contract it received.

    dtrain launch --nproc-per-node 2 -- python -m trainer.hello
"""

from __future__ import annotations

import os
import socket

import workerenv


def main() -> None:
    env = workerenv.WorkerEnv.from_environ()
    pmi = "PMI_FD" if workerenv.PMI_FD in os.environ else (
        "PMI_PORT" if workerenv.PMI_PORT in os.environ else "none")
    print(f"hello from rank {env.rank}/{env.world_size} on {socket.gethostname()} "
          f"(node {env.node_rank}, local {env.local_rank}/{env.local_world_size}, "
          f"master {env.master_addr}:{env.master_port}, job {env.job_id}, pmi {pmi})",
          flush=True)


if __name__ == "__main__":
    main()
