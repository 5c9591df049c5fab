"""The plain single-device GPT, the reference every parallel layout is compared against.

* `trainer.model.config`     `GPTConfig` (size and shape) and the ``--model`` presets
* `trainer.model.layers`     norms, rotary embeddings, attention, MLP, the pre-norm block
* `trainer.model.linear`     the linears' kernel: fp32 products on a CPU through oneDNN
* `trainer.model.documents`  document masking of packed windows: document ids, the mask
* `trainer.model.gpt`        `GPT`: embedding, blocks, head, deterministic init, the loss
* `trainer.model.precision`  losses, norms and main gradients in at least fp32 (shared with
  every parallel layer)
* `trainer.model.llama_config`  `LlamaShape`: the Llama family's own fields (GQA, the SwiGLU
  size rule, rope scaling)
* `trainer.model.llama`     `Llama`: the GPT's decoder with RMSNorm, SwiGLU, grouped-query
  attention and half-split rotary embeddings
* `trainer.model.family`    which class builds ``cfg.arch``: `build_model`
* `trainer.model.flops`      model FLOPs per token and MFU
"""
