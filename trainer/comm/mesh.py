"""The mesh of a run: one object that knows every axis, every group and this rank's place.

`Mesh.build` splits the world communicator into one group per axis of `trainer.comm.topology`
(tp, cp, ep, edp, pp, dp = ep x edp, and dp_cp, edp_cp: the gradients' groups, which
take cp in), always, size-1 groups included, so code never asks
whether a group exists::

    mesh = Mesh.build(world.comm, MeshShape(dp=2, tp=2, pp=2), world.device)
    mesh.rank("tp"), mesh.size("dp"), mesh.group("pp"), mesh.is_last("pp")
    mesh.group()      # the world

The splits are collective and run in one fixed order on every rank. Nothing is global: the
mesh is handed to whoever needs a group (`trainer.training.run.build_run(cfg, mesh)`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from trainer.comm.protocol import Communicator
from trainer.comm.topology import AXES, SPANS, MeshShape
from trainer.errors import TopologyError

#: The groups every mesh has, split in this order: every axis, then every span but the world
#: (which is the communicator itself).
GROUPS: tuple[tuple[str, ...], ...] = (*((axis,) for axis in AXES),
                                       *((span,) for span in SPANS if span != "world"))
_NAMES: dict[tuple[str, ...], str] = {axes: span for span, axes in SPANS.items()}


def splits(shape: MeshShape) -> list[tuple[str, ...]]:
    """The groups `Mesh.build` splits the world into, in order: every one of `GROUPS` but, at
    cp 1, the gradients' groups over dp and cp (dp_cp is dp, edp_cp is edp), so that a run
    without context parallelism splits and times what it did before the axis existed."""
    seen: set[tuple[str, ...]] = set()
    out = []
    for names in GROUPS:
        axes = shape.axes(*names)
        if shape.cp == 1 and "cp" in axes and tuple(a for a in axes if a != "cp") in seen:
            continue
        seen.add(axes)
        out.append(names)
    return out


class Mesh:
    """This rank's place on the named axes of a run, and a communicator for each group."""

    def __init__(self, shape: MeshShape, rank: int, device: torch.device,
                 groups: Mapping[tuple[str, ...], Communicator]) -> None:
        self.shape, self.device = shape, device
        self._rank = rank
        self._groups = dict(groups)

    @classmethod
    def build(cls, world: Communicator, shape: MeshShape, device: torch.device) -> Mesh:
        """Split ``world`` into the groups of ``shape`` (collective over ``world``: one split
        per group of `splits`, in that order)."""
        shape.check_world(world.size)
        rank = world.rank
        groups = {AXES: world}
        split = splits(shape)
        for names in GROUPS:
            axes = shape.axes(*names)
            if names in split:
                groups[axes] = world.split(shape.color(rank, *names), shape.coord(rank, *names),
                                           name=_NAMES.get(axes, "+".join(axes)))
            else:  # cp 1 adds nobody: the same communicator (and name) as without cp
                groups[axes] = groups[tuple(a for a in axes if a != "cp")]
        return cls(shape, rank, device, groups)

    def group(self, *axes: str) -> Communicator:
        """The communicator of this rank's group along ``axes`` (none: the world)."""
        key = self.shape.axes(*axes)
        if key not in self._groups:
            raise TopologyError("no such group in the mesh", "+".join(axes),
                                f"the mesh splits {', '.join('+'.join(g) for g in GROUPS)} "
                                "and the world", "Ask for one of them")
        return self._groups[key]

    def rank(self, *axes: str) -> int:
        """This rank's index in its group along ``axes`` (none: its global rank)."""
        return self.shape.coord(self._rank, *axes)

    def size(self, *axes: str) -> int:
        """The number of ranks of a group along ``axes`` (none: the world size)."""
        return self.shape.size(*axes)

    def is_first(self, *axes: str) -> bool:
        return self.rank(*axes) == 0

    def is_last(self, *axes: str) -> bool:
        return self.rank(*axes) == self.size(*axes) - 1

    def wrapped(self, wrap: Callable[[tuple[str, ...], Communicator], Communicator]) -> Mesh:
        """The same mesh with every group replaced by ``wrap(axes, group)`` (e.g. timed)."""
        return Mesh(self.shape, self._rank, self.device,
                    {axes: wrap(axes, comm) for axes, comm in self._groups.items()})

    def __repr__(self) -> str:
        return f"Mesh(rank {self._rank}: {self.shape}, {self.shape.coords(self._rank)})"
