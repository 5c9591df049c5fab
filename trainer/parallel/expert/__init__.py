"""Mixture of experts with expert parallelism (Megatron-core ``transformer/moe``'s design).

    checks     the --ep layout and what MoE models refuse, before any work (pure)
    router     scores, top-k, load-balancing and z-loss, capacity dropping (pure torch)
    dispatch   permute, count exchange, all-to-all over EP, sort by expert; combine reverses it
    layer      the MoE module that replaces a block's MLP; the auxiliary loss in backward
    parallel   expert sharding over the EP and TP groups; the experts' DP replica axes

The MoE fields of the model are `trainer.model.config.MoEConfig`; the expert load per step
and its heat map, `trainer.training.expert_load`.

`--moe-experts E --moe-topk k --moe-every n` turns the MLP of layers 0, n, 2n, ... into E
experts; `--ep N` splits each layer's experts over N data-parallel ranks.
"""
