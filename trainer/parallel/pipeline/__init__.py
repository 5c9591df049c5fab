"""Pipeline parallelism: schedules as per-rank action lists, their static checker, the runtime
that executes one rank's list over a PP communicator, and the timeline of what ran when.

* `trainer.parallel.pipeline.actions`   the vocabulary: ``Action``, ``Kind``, ``ScheduleError``
  (pure);
* `trainer.parallel.pipeline.schedule`  builders: ``gpipe``, ``one_f_one_b``, ``interleaved``
  (pure);
* `trainer.parallel.pipeline.placement` where the p2p actions go between compute slots (pure);
* `trainer.parallel.pipeline.check`     ``check_schedule``: simulates every rank's list without
  running
  anything (matching p2p, deadlock, dependencies, in-flight activations) (pure);
* `trainer.parallel.pipeline.runtime`   ``run_schedule``: runs one rank's list on a `Stage`;
* `trainer.parallel.pipeline.timeline`  Chrome trace / Perfetto JSON, PNG Gantt chart, bubble
  fraction;
* `trainer.parallel.pipeline.partition` which layers each of the p·v stage chunks holds (pure);
* `trainer.parallel.pipeline.stages`    a rank's chunks of the real GPT as a `Stage` (tied
  embeddings);
* `trainer.training.pipeline_step` one optimizer step: schedule, tied-embedding and DP gradient
  sums, the loss broadcast, the norm scope across TP and PP.
"""
