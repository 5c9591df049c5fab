"""The layout planner: which layouts of a model fit a cluster, and which runs fastest, before
any GPU is booked (`python -m trainer.plan`).

    cluster    the GPUs (by name or by numbers) and the links between them
    shapes     a rank's parameters and activations, measured on the trainer's own model built
               without memory (meta and fake tensors), never a second copy of the formulas
    operations a rank's operations, FLOPs, bytes and message steps per step, counted on the
               trainer's own model on fake tensors (the step time's work)
    estimate   memory per GPU, communication per step and link, step time and MFU of a layout
               (the cost model), the layouts of a cluster and their ranking
    report     the table and the JSON the command prints
    routing    the rows the experts' all-to-all sends, routed as the run's first step routes
    sends      the bytes one rank sends per step in each kind of group (dp, tp, pp, ep, cp)
    traffic    the bytes a run's communicators send, counted as the planner prices them
    budget     --memory-budget: a layout whose model state does not fit refused before building
"""
