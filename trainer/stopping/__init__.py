"""When training stops before ``--steps``.

    time_limit   ``--time-limit``: stop after S seconds, every rank after the same step
    agreement    every rank stops after the same step: a vote overlapped with the next (pure)
    sigterm      SIGTERM: finish the step, agree, checkpoint, exit 143 (adapter)
"""
