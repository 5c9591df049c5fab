"""The optimizer side of a step: AdamW, the learning rate, clipping, fp32 main weights.

* `trainer.optim.optimizer`        AdamW (decay on matrices only) and the warmup-cosine schedule
* `trainer.optim.grad_clip`        the global gradient norm over model-parallel groups, clipping
* `trainer.optim.main_weights`     what AdamW steps, one interface for the three holders
* `trainer.optim.mixed_precision`  ``--precision bf16``: bf16 model, fp32 main weights and
  gradients
"""
