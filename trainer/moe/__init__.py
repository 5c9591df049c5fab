"""Mixture of experts with expert parallelism (Megatron-core ``transformer/moe``'s design).

    checks     MoE model fields and the --ep layout, refused before any work (pure)
    router     scores, top-k, load-balancing and z-loss, capacity dropping (pure torch)
    dispatch   permute, count exchange, all-to-all over EP, sort by expert; combine reverses it
    layer      the MoE module that replaces a block's MLP; the auxiliary loss in backward
    parallel   EP/EDP groups carved from DP, expert sharding over EP and TP, the two DP
               reductions, the gradient-norm scope, the checkpoint writers
    load       expert load per layer and step for metrics.jsonl; the expert_load.png heat map

`--moe-experts E --moe-topk k --moe-every n` turns the MLP of layers 0, n, 2n, ... into E
experts; `--ep N` splits each layer's experts over N data-parallel ranks.
"""
