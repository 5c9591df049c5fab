"""The plain single-device GPT, the reference every parallel layout is compared against.

* `trainer.model.config`     `GPTConfig` (size and shape) and the ``--model`` presets
* `trainer.model.layers`     norms, rotary embeddings, attention, MLP, the pre-norm block
* `trainer.model.gpt`        `GPT`: embedding, blocks, head, deterministic init, the loss
* `trainer.model.precision`  losses, norms and main gradients in at least fp32 (shared with
  every parallel layer)
* `trainer.model.flops`      model FLOPs per token and MFU
"""
