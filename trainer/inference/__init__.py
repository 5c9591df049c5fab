"""Using a model rather than training it: the validation loss during training
(`validation`), a checkpoint of any layout back into the single-device GPT (`merge`) and
sampling bytes from it (`sampling`, run by ``python -m trainer.generate``)."""
