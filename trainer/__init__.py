"""dtrain's trainer: DP/TP/PP GPT and Llama training on MPI or NCCL communicators (never imports
launcher/).

Module map. Entry points stay at the top, where users call them; everything else lives in a
subpackage named for its concept. Subpackages import each other without a cycle, roughly
bottom-up: comm, gpu, model < parallel/* (tensor, pipeline, expert, data, zero, context), optim,
data < config < training < the entry points (`tests/project/test_layers.py` checks it, and that no
module is
over 400 lines).

    train        `python -m trainer.train`: the training loop, checkpoints, the entry point
    diagnose     `python -m trainer.diagnose`: communication soundness and bandwidth
    generate     `python -m trainer.generate`: sample text from a run's newest checkpoint
    export       `python -m trainer.export`: a Llama run's checkpoint as a Hugging Face folder
    hello        `python -m trainer.hello`: each rank prints the worker contract it received
    errors       the exception hierarchy (base in workerenv.py)
    schema       how a config dataclass declares its options (help, bounds, flag, TOML key)
    config/      options, sections, common, flags, toml_file: flags and TOML into one frozen
                 TrainConfig in sections
    training/    startup, run, step, pipeline_step, readout, guard, metrics, expert_load,
                 resume, restart, checkpointing: one run, from start-up to the last checkpoint
                 (restart: a restarted round resumes by itself and fits a smaller world;
                 checkpointing: what a save step stages, written in the background)
    stopping/    time_limit, agreement, sigterm: stopping before --steps, every rank after the
                 same step (SIGTERM: checkpoint, exit 143)
    model/       config, layers, linear, gpt, precision, flops: the plain single-device GPT;
                 llama_config, llama, family: the Llama family on the same decoder
    hf/          config, names, weights, folder: Hugging Face Llama folders both ways
    dashboards/  names, tb_sink, wandb_sink, hub: TensorBoard and W&B views of the metrics
    optim/       optimizer (AdamW, schedule), grad_clip, mixed_precision (bf16, fp32 main)
    data/        corpus, batches: byte-level data and deterministic DP-sharded batches;
                 prepare, shard_writer, token_files, token_batches, sources: tokenized datasets
    comm/        the Communicator protocol, its mpi/ and nccl/ backends, the mesh (named
                 axes and their groups), timing, progress records
    parallel/    data, tensor, pipeline, expert, zero, context: the ways a model is split
                 over ranks, one subpackage each
    activations/ sequence parallelism and activation recomputation
    construction/  per-rank model construction on the meta device
    placement/   where every tensor lies: its global name and shape, TP cut, ZeRO-1 range,
                 replicas; who counts and who writes each slice
    checkpoint/  atomic, verified checkpoints of safetensors and JSON, resumed at any layout;
                 the writer commits them in a background thread
    inference/   validation loss, sampling, merging checkpoint shards
    gpu/         GPU settings, compile, vocab padding
    health/      rank-side probes of `dtrain check --perf`
    stopping/    when training stops before --steps: --time-limit
    sparse/      model-parallel sparse embeddings (SOK style)
    recsys/      `python -m trainer.recsys`: a DLRM-style recommender on sparse/
    plan/        `python -m trainer.plan`: cluster, shapes, estimate, report: which layouts
                 of a model fit a cluster and which runs fastest, from the trainer's own model

Design notes the code relies on: docs/design.md.
"""
