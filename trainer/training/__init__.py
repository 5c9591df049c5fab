"""One training run of `python -m trainer.train`, from start-up to the last checkpoint.

* `trainer.training.startup`        every check of the user's input before training, told once
* `trainer.training.run`            `build_run(cfg, mesh)`: model, gradient sync, main weights,
                                    step body, data of one rank, each chosen once
* `trainer.training.step`           one optimizer step (all microbatches), straight through
* `trainer.training.body`           the step body's interface; plain gradient accumulation
* `trainer.training.pipeline_step`  the body under ``--pp``: schedule, tied weights, timeline
* `trainer.training.readout`        a logging interval's losses and norms in one host read
* `trainer.training.guard`          a diverged run stops on every rank before the bad step
* `trainer.training.metrics`        ``metrics.jsonl``, console lines, ``loss.png``
* `trainer.training.expert_load`    MoE expert load per step and ``expert_load.png``
* `trainer.training.resume`         what a checkpoint records and how ``--resume`` loads it
* `trainer.training.budget`         ``--memory-budget`` held to each step's measured bytes
* `trainer.training.plan_check`     the run's own plan (`trainer.plan`): rank 0's line, and the
                                    memory check after step 1
"""
