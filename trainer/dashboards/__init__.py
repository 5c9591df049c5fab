"""Metrics where users look: TensorBoard event files and Weights & Biases, from one rank.

* `trainer.dashboards.names`      the scalars of a step under the names torchtitan and
  Megatron-LM use
* `trainer.dashboards.tb_sink`    ``--tensorboard``: event files through the ``tensorboard``
  package's own writer (no TensorFlow)
* `trainer.dashboards.wandb_sink` ``--wandb offline|online``: a W&B run, when ``wandb`` is
  installed
* `trainer.dashboards.hub`        the sinks a run asked for, fed each logged step

``metrics.jsonl`` and the PNG plots (`trainer.training.metrics`) stay the record of a run; these
sinks are views of the same numbers.
"""
