"""The order in which a save's files become durable (`trainer.checkpoint.commit`): every file
the commit record names is fsynced before the record is renamed into place, whether its writer
fsynced it or left it to the leader's commit (`Save.leader_syncs`), and the folders after it.

Two ranks of one group run in this process one after the other (a group whose collectives
have nothing to wait for), as the ranks of one host do; every fsync and rename is logged."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.checkpoint import MARKER, checksum, rank_file
from trainer.checkpoint.files import FileRecord, verify_file
from trainer.checkpoint.layout import committed
from trainer.checkpoint.save import Save, claim, opened
from trainer.comm.protocol import ReduceOp


class _OneOfTwo:
    """Rank ``rank`` of a group of two whose collectives the test runs for it: each rank's
    values are its own (every write succeeded)."""

    size = 2

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def all_reduce(self, t: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *,
                   async_op: bool = False) -> None:
        pass

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        pass


def _logged(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """(``fsync``, path) and (``rename``, new path), in the order they returned (fsyncs run
    in several threads)."""
    log: list[tuple[str, str]] = []
    lock = threading.Lock()
    fsync, rename = os.fsync, os.rename

    def fsynced(fd: int) -> None:
        fsync(fd)
        with lock:
            log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))

    def renamed(src: Any, dst: Any, **kw: Any) -> None:
        rename(src, dst, **kw)
        with lock:
            log.append(("rename", str(dst)))

    monkeypatch.setattr(os, "fsync", fsynced)
    monkeypatch.setattr(os, "rename", renamed)
    return log


def _save_of_two(root: Path, *, leader_syncs: bool) -> Save:
    """Both ranks write their tensor file (rank 1 first), then the leader commits; the
    leader's save."""
    token, error = claim(root, 1)
    assert error is None
    saves = []
    for rank in (1, 0):
        tensors = {"w": torch.full((3000 + rank,), float(rank))}
        job = opened(root, 1, token, None, tensors=tensors, contents=[rank], meta={"m": 1},
                     keep=0, group=_OneOfTwo(rank), device=torch.device("cpu"))  # type: ignore[arg-type]
        assert job is not None
        job.leader_syncs = leader_syncs
        job.write()
        saves.append(job)
    leader = saves[-1]
    leader.settle(None)
    leader.commit()
    return leader


@pytest.mark.parametrize("leader_syncs", [True, False], ids=["left-to-the-leader", "own"])
def test_every_file_the_record_names_is_durable_before_the_record_is_named_committed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, leader_syncs: bool) -> None:
    log = _logged(monkeypatch)
    leader = _save_of_two(tmp_path, leader_syncs=leader_syncs)
    monkeypatch.undo()
    final = leader.final
    assert committed(final)
    named = json.loads((final / MARKER).read_text())["files"]
    assert {rank_file(0), rank_file(1)} <= set(named)
    records = {name: FileRecord(r["size"], r[checksum.WRITTEN]) for name, r in named.items()}
    for name in named:
        verify_file(final, name, records)
    marker = log.index(("rename", str(final / MARKER)))
    durable = {Path(path).name for what, path in log[:marker] if what == "fsync"}
    assert set(named) <= durable  # each under the temporary folder's name then
    assert {("fsync", str(tmp_path)), ("fsync", str(final))} <= set(log[marker:])
    fsyncs_of_the_leaders_file = [p for what, p in log
                                  if what == "fsync" and p.endswith(rank_file(0))]
    assert len(fsyncs_of_the_leaders_file) == 1
