"""Checkpoint save and load: the safetensors format of placed slices against the pickle format
it replaced, and a resume at another layout.

    python -m bench.checkpoint [--model small] [--reps 3] [--before REV] [--json PATH]

Each side trains the ``--model`` preset one step at dp2 x tp2 (4 ranks under the MPICH wheel's
``mpiexec``, fp32, AdamW) and saves it ``--reps`` times (`bench/workers/checkpoint_rank.py`);
then the run is resumed at the same layout and, for the new format, at other layouts of 4 ranks
(dp1 x tp4, dp4 x tp1, dp1 x tp2 x pp2), each resume once per repetition.

* ``after``: this checkout. Each slice is written once, by one of the ranks holding it.
* ``before``: the trainer at ``--before`` (default: the last commit that wrote format 2, one
  ``torch.save`` pickle per model and optimizer shard, written by DP replica 0), exported from
  this repository's git history into a temporary folder and run with the same Python. A
  resume at another layout is refused by that format, so it has no such rows. Without git
  history (an exported tree) this side is skipped with the reason.

Columns: ``save s`` the slowest rank's save (median over repetitions: it ends when the last
rank's files are committed); ``bytes/rank`` what each rank passed to ``write()`` during one save
(``/proc/self/io``), rank 0 first; ``load s`` the slowest rank's load inside ``build_run`` (the
trainer's restore, median); ``extra MiB`` the largest rise of a rank's resident anonymous memory
during the load above what it held when the load began (``+ mapped``: with the pages of the
memory-mapped tensor files counted too: clean page cache the kernel can drop); ``own MiB`` the
rank's own parameters and optimizer state; ``beyond own MiB`` the extra memory less the
optimizer state the load creates (AdamW has none before its first step), i.e. what the load
holds beyond the rank's own shard; ``piece MiB`` the largest single slice in the checkpoint (the
target: beyond the own shard, no more than one piece of one tensor).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import common

BEFORE = "ee1c59d"
"""The last commit whose trainer wrote checkpoint format 2 (pickles), before placements."""
WORKER = common.WORKERS / "checkpoint_rank.py"
SAVED = "dp2,tp2"
LOADS = ("dp2,tp2", "dp1,tp4", "dp4,tp1", "dp1,tp2,pp2")
SUMMARY_COLUMNS = [("side", "side"), ("layout", "layout"), ("save s", "save_s"),
                   ("bytes/rank", "bytes_per_rank"), ("load s", "load_s"),
                   ("extra MiB", "extra_mib"), ("+ mapped MiB", "extra_mapped_mib"),
                   ("own MiB", "own_mib"), ("beyond own MiB", "beyond_own_mib"),
                   ("piece MiB", "piece_mib")]
MIB = 2 ** 20
MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
"""glibc serves every allocation of 128 KiB or more from its own mapping, returned when freed
(by default the threshold rises after the first such free, and freed heap memory stays
resident), so a rank's resident memory follows what it holds."""
_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2}


def _flags(model: str, layout: str, run_dir: Path) -> list[str]:
    sizes = dict(part.split("=") if "=" in part else (part[:2], part[2:])
                 for part in layout.split(","))
    out = ["--model", model, "--steps", "1000", "--keep", "0", "--eval-every", "0",
           "--data-cap-mb", "1", "--run-dir", str(run_dir)]
    for axis in ("dp", "tp", "pp"):
        out += [f"--{axis}", sizes.get(axis, "1")]
    return out


def _ranks(tree: Path, phase: str, flags: list[str], reps: int, timeout: float
           ) -> list[dict[str, Any]]:
    from testbed.mpiexec import clean_env, run_mpiexec

    with tempfile.TemporaryDirectory(prefix="dtrain-bench-ckpt-") as out:
        proc = run_mpiexec(4, [sys.executable, str(WORKER), phase, out, *flags],
                           timeout=timeout, env=clean_env({"PYTHONPATH": str(tree),
                                                           "REPS": str(reps), **MALLOC}))
        files = sorted(Path(out).glob("rank*.json"))
        if proc.returncode != 0 or len(files) != 4:
            raise RuntimeError(f"checkpoint {phase} failed:\n{proc.stdout[-3000:]}")
        return [json.loads(f.read_text()) for f in files]


def _largest_piece(run_dir: Path) -> int | None:
    """Bytes of the largest slice in the newest checkpoint's tensor files (new format)."""
    from safetensors import safe_open

    folders = sorted((run_dir / "checkpoints").glob("step-*"))
    files = list(folders[-1].glob("rank-*.safetensors")) if folders else []
    largest = None
    for path in files:
        with safe_open(path, "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                piece = f.get_slice(key)
                numel = math.prod(piece.get_shape())
                largest = max(largest or 0, numel * _BYTES[piece.get_dtype()])
    return largest


def _side(name: str, tree: Path, model: str, reps: int, timeout: float,
          progress: Any) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(prefix=f"dtrain-bench-ckpt-{name}-") as tmp:
        run_dir = Path(tmp) / "run"
        progress(f"{name}: save at {SAVED}")
        saved = _ranks(tree, "save", _flags(model, SAVED, run_dir), reps, timeout)
        save_s = statistics.median(max(r["saves"][i]["s"] for r in saved) for i in range(reps))
        piece = _largest_piece(run_dir)
        for layout in LOADS if name == "after" else LOADS[:1]:
            progress(f"{name}: load at {layout}")
            loads = [_ranks(tree, "load", [*_flags(model, layout, run_dir), "--resume"], 1,
                            timeout) for _ in range(reps)]
            rows.append({
                "side": name, "layout": layout.replace(",", " x "), "model": model,
                "save_s": save_s if layout == SAVED else None,
                "bytes_per_rank": [r["saves"][-1]["bytes"] for r in saved]
                if layout == SAVED else None,
                "load_s": statistics.median(max(r["load_s"] for r in rs) for rs in loads),
                "extra_mib": max(r["extra_anon"] for rs in loads for r in rs) / MIB,
                "extra_mapped_mib": max(r["extra_total"] for rs in loads for r in rs) / MIB,
                "own_mib": max(r["held_bytes"] for r in loads[0]) / MIB,
                "beyond_own_mib": max(r["extra_anon"] - r["state_bytes"]
                                      for rs in loads for r in rs) / MIB,
                "piece_mib": piece / MIB if piece else None})
    return rows


def _export(rev: str, into: Path) -> Path:
    """The tree of ``rev`` from this repository's history, or Skip."""
    try:
        archive = subprocess.run(["git", "-C", str(common.REPO), "archive", rev],
                                 capture_output=True, check=True, timeout=120).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise common.Skip(f"no git history to export {rev} from ({exc})") from None
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def run(model: str = "small", reps: int = 3, before: str = BEFORE, timeout: float = 600,
        progress: Any = print) -> list[dict[str, Any]]:
    rows = _side("after", common.REPO, model, reps, timeout, progress)
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-ckpt-before-") as tmp:
        try:
            tree = _export(before, Path(tmp))
        except common.Skip as why:
            progress(f"before: skipped ({why})")
            return rows
        return _side("before", tree, model, reps, timeout, progress) + rows


def print_table(rows: list[dict[str, Any]]) -> None:
    common.print_rows("Checkpoint save/load per rank: safetensors slices vs format-2 pickles "
                      f"({rows[0]['model']} model saved at dp2 x tp2)", rows, SUMMARY_COLUMNS)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.checkpoint", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", help="GPT preset")
    ap.add_argument("--reps", type=int, default=3, help="saves and loads of each side")
    ap.add_argument("--before", default=BEFORE, help="git revision of the old format's trainer")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", help="also write the rows to this file")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    opts = {k: v for k, v in vars(args).items() if k != "json"}
    return common.report(run(**opts), print_table, args.json)


if __name__ == "__main__":
    sys.exit(main())
