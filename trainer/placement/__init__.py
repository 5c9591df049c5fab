"""Where every tensor of a run lies: one `Placement` per parameter and main weight.

* `trainer.placement.slices`      `Placement` (global name and shape, the TP cut, the ZeRO-1
                                  range, the replica axes), its runs in the global tensor and
                                  the copies between two placements (pure)
* `trainer.placement.parameters`  the placement of every parameter of a rank's model (modules
                                  that split themselves do so first), who counts a tensor once
                                  (the norm), who writes it (a save), its DP replica axes
"""

from trainer.placement.parameters import dp_axes, leads, place_parameters, placement_of, writers
from trainer.placement.slices import Copy, Placement, TPSplit, copies, runs

__all__ = ["Copy", "Placement", "TPSplit", "copies", "dp_axes", "leads", "place_parameters",
           "placement_of", "runs", "writers"]
