"""Megatron-style data parallelism on the `Communicator` (not torch DDP).

* `trainer.parallel.data.grad_sync`  `DataParallel`: one contiguous gradient buffer, bucketed
  all-reduce overlapped with backward, ``no_sync`` for accumulation
* `trainer.parallel.data.split`      `data_parallel`: one `DataParallel` per kind of replica
  (the whole DP group; the axes a parameter's ``dp_replicas`` names), `SplitDataParallel`
  joining them
* `trainer.parallel.data.buckets`    how the buffer is cut into buckets; a bucket's state; the
  comm thread's handle and policy
"""
