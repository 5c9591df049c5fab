"""Training metrics on rank 0: one JSON line per step, console lines, and a loss-curve PNG.

``metrics.jsonl`` (in the run dir) gets every step as one JSON object, so the loss curve and
timing of a run can be read back exactly; a resumed run first drops the lines after its
checkpoint step, so the file always describes one consistent history. The console shows a rich
progress bar on a terminal and plain lines otherwise (e.g. when a launcher relays the output).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

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
    """Blocked waiting for (or running) the DP gradient all-reduces after backward."""
    comm_total_s: float = 0.0
    """Inside the DP all-reduces wherever they ran (0 when the backend hides it, e.g. NCCL)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s if self.step_s > 0 else 0.0

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "tokens_per_s": round(self.tokens_per_s, 1)})


def read_records(path: Path) -> list[dict[str, Any]]:
    """Records of a metrics file; for a step written twice the last line wins."""
    by_step: dict[int, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]


def truncate_after(path: Path, step: int) -> None:
    """Keep the records of steps <= ``step`` (a resumed run rewrites what came after)."""
    if not path.exists():
        return
    kept = [json.dumps(r) for r in read_records(path) if r["step"] <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def plot_loss(records: list[dict[str, Any]], png: Path, *, title: str = "") -> None:
    """Loss against step as a PNG (matplotlib's Agg backend, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title(title or "training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


class MetricsLog:
    """Rank 0's sink for step records; on other ranks every method does nothing."""

    def __init__(self, run_dir: Path, *, enabled: bool, total_steps: int, start_step: int,
                 log_every: int) -> None:
        self.enabled, self.log_every = enabled, log_every
        self.path = run_dir / METRICS_FILE
        self._console = Console(stderr=True, soft_wrap=True)
        self._progress: Progress | None = None
        self._window: list[StepRecord] = []
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        truncate_after(self.path, start_step)
        # Open for the whole run (closed in close()), one flushed line per step.
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        if self._console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
                console=self._console, transient=False)
            self._task = self._progress.add_task("train", total=total_steps,
                                                 completed=start_step, status="")
            self._progress.start()

    def info(self, text: str) -> None:
        if self.enabled:
            self._console.print(text, highlight=False)

    def record(self, rec: StepRecord) -> None:
        if not self.enabled:
            return
        self._file.write(rec.to_json() + "\n")
        self._file.flush()
        self._window.append(rec)
        if self._progress is not None:
            self._progress.update(self._task, completed=rec.step, status=f"loss {rec.loss:.4f}")
        if rec.step % self.log_every == 0:
            self.info(summarize(self._window))
            self._window = []

    def close(self, *, plot_title: str = "") -> None:
        if not self.enabled:
            return
        if self._window:
            self.info(summarize(self._window))
        if self._progress is not None:
            self._progress.stop()
        self._file.close()
        records = read_records(self.path)
        if records:
            plot_loss(records, self.path.with_name(PLOT_FILE), title=plot_title)


def summarize(window: list[StepRecord]) -> str:
    """One log line for an interval: last step and loss, mean throughput and time split."""
    last, n = window[-1], len(window)
    step_s = sum(r.step_s for r in window)
    tokens = sum(r.tokens for r in window)
    compute = sum(r.compute_s for r in window) / n
    comm = sum(r.comm_exposed_s for r in window) / n
    total = sum(r.comm_total_s for r in window) / n
    in_calls = f" (all-reduce calls {1e3 * total:.1f} ms)" if total > 0 else ""
    return (f"step {last.step:>6} | loss {last.loss:.4f} | lr {last.lr:.2e} | "
            f"gnorm {last.grad_norm:.3f} | {tokens / step_s if step_s else 0:,.0f} tok/s | "
            f"step {1e3 * step_s / n:.1f} ms = compute {1e3 * compute:.1f} + "
            f"exposed comm {1e3 * comm:.1f} ms{in_calls}")
