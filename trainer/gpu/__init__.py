"""The GPU path of the trainer: what makes a step cheap on a GPU, and still right on a CPU.

    settings   TF32 matmuls for fp32 CUDA runs; fused AdamW on CUDA, the per-tensor loop elsewhere
    compile    --compile: torch.compile of every block, or one message and eager blocks
    vocab      vocabulary padding to 128 x tp rows, padded rows masked out of the logits

A step's loss and gradient norm stay on the device and are read once per logging interval
(`trainer.training.readout`). The DP gradient all-reduce's overlap with backward on CUDA lives
where the buckets do (`trainer.parallel.data.grad_sync`, on the NCCL communicator's side
stream, `trainer.comm.nccl`).
"""
