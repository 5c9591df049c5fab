"""The help text of every training option (`trainer.config.options`), one line of ``--help`` each.

Kept apart from the option checks so that each file stays readable; the keys are the field
names of `trainer.config.options.TrainConfig`, and a test checks that every field has one.
"""

from __future__ import annotations

from trainer.model.config import PRESETS

HELP: dict[str, str] = {
    "model": "model size preset: " + ", ".join(PRESETS),
    "steps": "optimizer steps to train in total (a resumed run stops at the same step)",
    "stop_at": "stop after this step with a checkpoint, to split a run into jobs (0 = --steps);"
               " the learning-rate schedule still spans --steps",
    "time_limit": "stop after this many seconds of training with a checkpoint, every rank after "
                  "the same step (checked every --log-every steps; 0 = no limit)",
    "global_batch": "sequences per optimizer step, summed over data-parallel ranks",
    "microbatches": "microbatches per step on each DP rank (gradient accumulation; with --pp "
                    "the microbatches the pipeline schedule runs)",
    "lr": "peak learning rate",
    "min_lr": "learning rate at the end of the cosine decay",
    "warmup_steps": "linear warmup steps",
    "decay_steps": "step at which the cosine decay reaches min_lr (0 = --steps)",
    "weight_decay": "AdamW weight decay of matrices",
    "grad_clip": "clip the global gradient norm to this value (0 = off)",
    "seed": "seed of initialisation, data order and dropout",
    "dp": "data-parallel size (0 = world size / (tp*pp))",
    "tp": "tensor-parallel size: heads, MLP width and vocabulary split over tp adjacent ranks",
    "ep": "expert-parallel size: the experts of each MoE layer split over ep DP ranks "
          "(trainer.moe); must divide dp and --moe-experts",
    "pp": "pipeline-parallel size: the layers split into pp stages on pp ranks",
    "schedule": "pipeline schedule: gpipe, 1f1b or interleaved (with --virtual-stages)",
    "virtual_stages": "model chunks per pipeline rank (interleaved schedule only)",
    "pp_layers": "layers per pipeline stage, e.g. 3,2,2,1 (default: balanced by layer count)",
    "sequence_parallel": "split the activations between tensor-parallel layers (norms, dropout, "
                         "residuals) along the sequence over the tp ranks (needs tp > 1)",
    "recompute": "activation recomputation in backward: none, selective (the attention core) or "
                 "full (every transformer block)",
    "backend": "communication backend: auto (nccl on GPU, else mpi), mpi or nccl",
    "bucket_size": "DP gradient bucket size in elements",
    "overlap": "overlap DP gradient all-reduce with backward",
    "precision": "auto (bf16 on CUDA, fp32 on CPU), fp32, or bf16: bf16 weights and activations "
                 "with fp32 main weights, gradients and optimizer (trainer.optim.mixed_precision)",
    "grad_reduce_dtype": "dtype of the DP gradient all-reduce: fp32 (the main gradients as they "
                         "are) or bf16 (half the bytes; each bucket rounded first)",
    "compile": "torch.compile every transformer block (checked at start-up; where it cannot "
               "work, one message and eager blocks, trainer.gpu.compile)",
    "zero": "ZeRO stage: 0 (every DP rank keeps the whole optimizer state) or 1 (gradients "
            "reduce-scattered, optimizer state and fp32 main weights sharded over DP, "
            "parameters all-gathered after the step; trainer.zero)",
    "peak_tflops": "peak TFLOP/s of one device for the logged MFU (0 = bf16 dense peak of a "
                   "known GPU: H100, H200, A100; a CPU logs MFU only when given)",
    "run_dir": "folder for checkpoints, metrics.jsonl and loss.png",
    "save_every": "save a checkpoint every N steps (0 = only at the end)",
    "keep": "number of newest checkpoints to keep (0 = all)",
    "resume": "continue from the newest committed checkpoint in --run-dir (none: start at step "
              "0); refused if its checksums do not verify",
    "resume_fallback": "with --resume, skip damaged checkpoints (each reported and renamed to "
                       "step-N.damaged-*) and resume from the newest that verifies",
    "overwrite": "start a new run in a --run-dir that holds another run's checkpoints (refused "
                 "without it): they and metrics.jsonl are moved to <run-dir>/replaced-<time>/",
    "skip_nonfinite": "skip at most N steps whose loss or gradient norm is NaN or Inf (their "
                      "update is dropped) before stopping; 0 = stop at the first",
    "data": "text file or folder to train on (default: the Python stdlib sources)",
    "data_cap_mb": "read at most this many MiB of training text (the validation split is read "
                   "after it)",
    "val_fraction": "hold out this last fraction of the data for validation (never trained on)",
    "eval_every": "log the validation loss every N steps and at the last step (0 = never)",
    "eval_batches": "validation batches (of --global-batch sequences) per evaluation",
    "log_every": "print a log line every N steps",
}
