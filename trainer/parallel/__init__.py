"""The ways a model is split over ranks, one subpackage per axis of the mesh
(`trainer.comm.topology`), each placing its own parameters (`trainer.placement`).

    data/      grad_sync (DataParallel), split (one per kind of replica), buckets
    tensor/    Megatron layers, mappings, RNG tracker, sharding, parallelize, gqa; sequence
               parallelism's regions live in trainer/activations
    pipeline/  schedules, their checker, the runtime, stages, timeline
    expert/    mixture of experts: router, dispatch, layer, expert parallelism
    zero/      ZeRO-1, 2, 3: sharded optimizer state, gradients, parameters (units)
    context/   layout (zig-zag split), plan (visible, diagonal and masked blocks), blocks,
               ring, allgather, attention: attention over a sequence split across a
               context-parallel group
"""
