"""The GPU path of the trainer: what makes a step cheap on a GPU, and still right on a CPU.

    vocab      vocabulary padding to 128 x tp rows, padded rows masked out of the logits
"""
