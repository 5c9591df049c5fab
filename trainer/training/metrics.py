"""Training metrics on rank 0: one JSON line per step, console lines, and a loss-curve PNG.

``metrics.jsonl`` (in the run dir) gets every step as one JSON object, so the loss curve and
timing of a run can be read back exactly; steps that evaluated carry ``val_loss`` (null on the
others). ``loss.png`` draws the training and validation loss against the step, and the
learning rate on a second axis. Communication time is split as in `trainer.comm.timing`:
``comm_exposed_s`` (the step waited on it) and ``comm_total_s`` (exposed plus what overlapped
compute, so never below the exposed time), over the DP, TP and PP groups. A resumed run first
drops the lines after its checkpoint step, so the file always describes one consistent history;
lines that do not parse (a torn write) are dropped then too, said once, and the file is
rewritten atomically.
Each console line can show the interval's MFU (`trainer.model.flops`). The console shows a rich
progress bar on a terminal and plain lines otherwise (e.g. when a launcher relays the output).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


@dataclass(frozen=True)
class StepRecord:
    """What one optimizer step measured. Times are seconds of this step on rank 0."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens: int
    step_s: float
    compute_s: float
    comm_exposed_s: float
    """The step waited on communication (DP, TP and PP): ``step_s - compute_s``."""
    comm_total_s: float = 0.0
    """Exposed plus communication that overlapped compute; >= comm_exposed_s."""
    val_loss: float | None = None
    """Validation loss after this step (steps that evaluated; None on the others)."""
    peak_mem_bytes: int = 0
    """Rank 0's peak memory during this step: CUDA max allocated, else peak RSS
    (`trainer.parallel.zero.memory.PeakMemory`)."""
    moe: dict[str, Any] | None = None
    """Expert load per MoE layer (`trainer.training.expert_load`); None for a dense model."""
    checkpoint: list[dict[str, Any]] | None = None
    """The saves seen committed at the end of this step, each with its step, MB and MB/s in
    all and per rank, and the seconds the loop was blocked (`trainer.training.checkpointing`);
    None on the others."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s if self.step_s > 0 else 0.0

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "tokens_per_s": round(self.tokens_per_s, 1)})


def parse_lines(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """The records of a JSON-lines file (objects with an integer ``step``), in file order, and
    the numbers of the lines that are not one: a torn write (NUL bytes after a power loss, a
    line cut off by a full disk). Blank lines are neither."""
    records, bad = [], []
    raw = path.read_bytes() if path.exists() else b""
    for number, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line.decode("utf-8"))
        except ValueError:  # JSONDecodeError and UnicodeDecodeError
            rec = None
        if isinstance(rec, dict) and type(rec.get("step")) is int:
            records.append(rec)
        else:
            bad.append(number)
    return records, bad


def read_records(path: Path) -> list[dict[str, Any]]:
    """Records of a metrics file, lines that do not parse skipped; for a step written twice
    the last line wins."""
    by_step = {rec["step"]: rec for rec in parse_lines(path)[0]}
    return [by_step[s] for s in sorted(by_step)]


def truncate_after(path: Path, step: int) -> str:
    """Keep the records of steps <= ``step`` (a resumed run rewrites what came after), written
    to a temporary file, fsynced and renamed over ``path``, so a crash leaves the old file or
    the new one. Returns the warning to print once when torn lines were dropped ("" if none)."""
    if not path.exists():
        return ""
    records, bad = parse_lines(path)
    by_step = {rec["step"]: rec for rec in records}
    kept = [json.dumps(by_step[s]) + "\n" for s in sorted(by_step) if s <= step]
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write("".join(kept))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    if not bad:
        return ""
    shown = ", ".join(map(str, bad[:5])) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
    return (f"warning: torn lines dropped [{path}, line(s) {shown}]: {len(bad)} line(s) are not "
            "JSON records (NUL bytes after a power loss, or a line cut off by a full disk); "
            "the file was rewritten without them")


def draw(plot: Callable[[Path], object], png: Path) -> str:
    """Run ``plot`` into a temporary file, then rename it to ``png``: a failed plot (a full
    disk) leaves the previous picture, never an empty one, and is only the returned warning
    ("" when drawn), never an error that would hide the one that ended the run."""
    tmp = png.with_name(f".{png.stem}.tmp-{os.getpid()}{png.suffix}")  # the suffix: the format
    try:
        plot(tmp)
        os.replace(tmp, png)
    except Exception as exc:  # noqa: BLE001 - any failure to draw is reported the same way
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else \
            f"{type(exc).__name__}: {exc}"
        return f"warning: {png.name} not written [{png}]: {why}. Its data are kept"
    return ""


def plot_loss(records: list[dict[str, Any]], png: Path, *, title: str = "") -> None:
    """Training and validation loss against step, the learning rate on a second axis, as a PNG
    (matplotlib's Agg backend, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    steps = [r["step"] for r in records]
    ax.plot(steps, [r["loss"] for r in records], lw=1.2, label="training loss")
    evals = [r for r in records if r.get("val_loss") is not None]
    if evals:
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", ms=3, lw=1.2,
                label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title(title or "training loss")
    ax.grid(alpha=0.3)
    lr_ax = ax.twinx()
    lr_ax.plot(steps, [r["lr"] for r in records], color="tab:gray", lw=0.8, ls="--",
               label="learning rate")
    lr_ax.set_ylabel("learning rate")
    lines = ax.get_legend_handles_labels()
    more = lr_ax.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper right", fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(png)
    finally:
        plt.close(fig)


class MetricsLog:
    """Rank 0's sink for step records; on other ranks every method does nothing."""

    def __init__(self, run_dir: Path, *, enabled: bool, total_steps: int, start_step: int,
                 log_every: int, mfu: Callable[[float], float] | None = None) -> None:
        self.enabled, self.log_every, self.mfu = enabled, log_every, mfu
        self.path = run_dir / METRICS_FILE
        self._console = Console(stderr=True, soft_wrap=True)
        self._progress: Progress | None = None
        self._window: list[StepRecord] = []
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        torn = truncate_after(self.path, start_step)
        # Open for the whole run (closed in close()), one flushed line per step; None once a
        # write failed (`_lost`).
        self._file: TextIO | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        if self._console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
                console=self._console, transient=False)
            self._task = self._progress.add_task("train", total=total_steps,
                                                 completed=start_step, status="")
            self._progress.start()
        self.info(torn)

    def info(self, text: str) -> None:
        """Print ``text`` on rank 0 (nothing for an empty text)."""
        if self.enabled and text:
            self._console.print(text, highlight=False, markup=False)  # "[...]" is text

    def record(self, rec: StepRecord) -> None:
        if not self.enabled:
            return
        if self._file is not None:
            try:
                self._file.write(rec.to_json() + "\n")
                self._file.flush()
            except OSError as exc:  # e.g. a full disk: warned once; the run goes on
                self._lost(exc, f"step {rec.step} and later steps are missing from it")
        self._window.append(rec)
        if self._progress is not None:
            self._progress.update(self._task, completed=rec.step, status=f"loss {rec.loss:.4f}")
        if rec.step % self.log_every == 0:
            self.info(summarize(self._window, self.mfu))
            self._window = []

    def close(self, *, plot_title: str = "") -> None:
        if not self.enabled:
            return
        if self._window:
            self.info(summarize(self._window, self.mfu))
        if self._progress is not None:
            self._progress.stop()
        if self._file is not None:
            try:
                self._file.close()
            except OSError as exc:
                self._lost(exc, "its last lines may be missing")
        records = read_records(self.path)
        if records:
            png = self.path.with_name(PLOT_FILE)
            self.info(draw(lambda tmp: plot_loss(records, tmp, title=plot_title), png))

    def _lost(self, exc: OSError, what: str) -> None:
        """Stop writing the metrics file after a write failed, saying so once."""
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):
                file.close()
        self.info(f"warning: metrics not written [{self.path}]: {exc.strerror or exc}; {what}")


def summarize(window: list[StepRecord], mfu: Callable[[float], float] | None = None) -> str:
    """One log line for an interval: last step and loss, mean throughput (and the MFU that
    ``mfu`` gives for it, `trainer.model.flops`) and time split."""
    last, n = window[-1], len(window)
    step_s = sum(r.step_s for r in window)
    tokens = sum(r.tokens for r in window)
    compute = sum(r.compute_s for r in window) / n
    comm = sum(r.comm_exposed_s for r in window) / n
    total = sum(r.comm_total_s for r in window) / n
    evals = [r.val_loss for r in window if r.val_loss is not None]
    val = f" | val {evals[-1]:.4f}" if evals else ""
    rate = tokens / step_s if step_s else 0.0
    util = f" | MFU {100 * mfu(rate):.2f}%" if mfu is not None else ""
    return (f"step {last.step:>6} | loss {last.loss:.4f}{val} | lr {last.lr:.2e} | "
            f"gnorm {last.grad_norm:.3f} | {rate:,.0f} tok/s{util} | "
            f"step {1e3 * step_s / n:.1f} ms = compute {1e3 * compute:.1f} + "
            f"exposed comm {1e3 * comm:.1f} ms (comm total {1e3 * total:.1f} ms)")
