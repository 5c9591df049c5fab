"""Using a model rather than training it: the validation loss during training
(`validation`), a checkpoint of any layout back into the single-device GPT (`merge`) and
sampling bytes from it (`sampling`, run by ``python -m trainer.generate``); a ZeRO-3 model
regathered in memory into a tensor-parallel layout to sample from and back (`switch`, the
Hybrid Engine's switch), and a run's checkpoint sampled that way (`from_run`,
``trainer.generate --from-run``)."""
