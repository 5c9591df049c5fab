"""An unmodified torch.distributed env:// script, as users already have them."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # reads MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} sum {t.item():.0f}", flush=True)
dist.destroy_process_group()
