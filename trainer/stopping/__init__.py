"""When training stops before ``--steps``: ``--time-limit`` (`trainer.stopping.time_limit`)."""
