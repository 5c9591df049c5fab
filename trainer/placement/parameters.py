"""Every parameter of a rank's model gets its `Placement` (``param.placement``), in one place,
from what each feature left on it: the TP cut (`trainer.parallel.tensor.sharding.shard_spec`),
the DP axes its copies span when they are not all of dp (``param.dp_replicas``: the experts
of `trainer.parallel.expert`, which split themselves when placed, `PlacesItself`), the pipeline's
copy of a
tied embedding. The optimizer's main weights take their parameter's placement (ZeRO-1's
pieces a part of it), so every tensor a checkpoint holds knows where it lies.

Two rules read the placements:

* `leads`: this rank counts the tensor in a global sum (the gradient norm): it is no copy, and
  this rank is the first of its replicas. Summed over the world, every element counts once.
* `writers`: one writer per slice, spread over the ranks that hold it. The replicas of a slice
  hold the same list of such slices, so each computes the same balanced assignment (largest
  first, to the least loaded; ties from a member that depends on the group, so that groups
  of the same axes do not all load their first member) without talking to the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from torch import nn

from trainer.comm.mesh import Mesh
from trainer.comm.topology import SPANS
from trainer.parallel.tensor.sharding import shard_spec
from trainer.placement.slices import Placement, TPSplit

DP_AXES = SPANS["dp_cp"]
"""The axes a gradient is reduced over: data parallelism and context parallelism (whose ranks
hold the same weights and different tokens of the same sequences); a parameter is the same on
all of them unless it says otherwise (``param.dp_replicas``)."""


@runtime_checkable
class PlacesItself(Protocol):
    """A module that splits its own parameters over the mesh when the run places the model
    (the experts of a MoE layer, `trainer.parallel.expert`), marking those that differ between DP
    ranks
    with the DP axes their copies span (``param.dp_replicas``)."""

    def place_on(self, name: str, mesh: Mesh) -> None: ...


def place_parameters(model: nn.Module, mesh: Mesh, *, copies: dict[str, str] | None = None
                     ) -> None:
    """Let every module of ``model`` that splits itself over the mesh do so, then set
    ``param.placement`` on every parameter. ``copies``: local names of parameters that copy
    another stage's tensor, and that tensor's global name (the tied head of the last stage:
    ``{"head.weight": "tok_emb.weight"}``)."""
    for module_name, module in model.named_modules():
        if isinstance(module, PlacesItself):
            module.place_on(module_name, mesh)
    copies = copies or {}
    tp_rank, tp_size = mesh.rank("tp"), mesh.size("tp")
    for name, p in model.named_parameters():
        spec = shard_spec(p)
        split = TPSplit(spec.dim, spec.stride, tp_rank, tp_size) \
            if spec is not None and tp_size > 1 else None
        shape = list(p.shape)
        if split is not None:
            shape[split.dim] *= tp_size
        replicated = (*mesh.shape.axes(*getattr(p, "dp_replicas", DP_AXES)),
                      *(("tp",) if split is None else ()))
        p.placement = Placement(  # type: ignore[attr-defined]  # a parameter's own placement
copies.get(name, name), tuple(shape), split, None, replicated,
                                copy=name in copies)


def placement_of(tensor: object) -> Placement:
    """The placement a parameter or main weight carries (`place_parameters`)."""
    found = getattr(tensor, "placement", None)
    if not isinstance(found, Placement):
        raise TypeError("a tensor without a placement reached the checkpoint or the norm "
                        "(place_parameters was not run on its model)")  # a wiring bug
    return found


def dp_axes(p: Placement) -> tuple[str, ...]:
    """The DP axes ``p``'s copies span: those its gradient is reduced over."""
    return tuple(axis for axis in p.replicated if axis in DP_AXES)


def leads(p: Placement, mesh: Mesh) -> bool:
    """This rank counts ``p``'s tensor in a world-wide sum (module docstring)."""
    return not p.copy and all(mesh.rank(axis) == 0 for axis in p.replicated)


def writers(placements: Sequence[Placement], mesh: Mesh) -> list[bool]:
    """For each slice this rank holds, whether this rank writes it (module docstring)."""
    mine = [False] * len(placements)
    by_axes: dict[tuple[str, ...], list[int]] = {}
    for i, p in enumerate(placements):
        if not p.copy:
            by_axes.setdefault(p.replicated, []).append(i)
    for axes, indices in by_axes.items():
        members, me = (mesh.size(*axes), mesh.rank(*axes)) if axes else (1, 0)
        # Where the assignment starts: the same on every member of the group, and different
        # for groups of other axes or other coordinates, so that no rank collects the largest
        # slice of every kind.
        first = (mesh.shape.color(mesh.rank(), *axes) + sum(len(a) for a in axes)) % members \
            if axes else 0
        load = [0] * members
        for i in sorted(indices, key=lambda i: (-placements[i].numel, placements[i].name)):
            who = min(range(members), key=lambda m: (load[m], (m - first) % members))
            load[who] += placements[i].numel
            mine[i] = who == me
    return mine
