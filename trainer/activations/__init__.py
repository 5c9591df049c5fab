"""Techniques that cut activation memory: sequence parallelism and activation recomputation.

    options            the --sequence-parallel / --recompute checks run when options are read
    sequence_parallel  Megatron's sequence parallelism wired into the tensor-parallel GPT
    recompute          --recompute none | selective | full, RNG-safe, inside every schedule

`trainer.training.run` applies both after `trainer.parallel.tensor.parallelize`; the layers and the
RNG-safe `checkpoint` they build on live in `trainer.parallel.tensor`.
"""

from trainer.activations.options import RECOMPUTE_MODES, check_sequence_split
from trainer.activations.recompute import apply_recompute
from trainer.activations.sequence_parallel import apply_sequence_parallel

__all__ = ["RECOMPUTE_MODES", "apply_recompute", "apply_sequence_parallel",
           "check_sequence_split"]
