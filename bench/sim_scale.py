"""The head at 256-4,096 hosts x 8 ranks, on a simulated cluster (`testbed.simcluster`).

    python -m bench.sim_scale [--sizes 256,1024,4096] [--per-host 8] [--fanouts 0,32]
                              [--exchanges light,mpich] [--rendezvous 1024]

The head is `dtrain launch` itself (its own process, `testbed.simhead`); each host is the real
agent, 64 to a process (`testbed.simjob.HOSTS_PER_WORKER`), reached over loopback TCP; each
rank a fake that plays MPICH's
PMI-1 conversation in MPI_Init and MPI_Finalize (put its card, fence, get 4 peers' cards,
fence, finalize) and exits. Per size, one job (t0 = just before the head's process starts):

* ``running``: every rank running; ``wired``: every rank past the fence and its gets (launch +
  wire-up); ``fence``: the last rank past the fence minus the last rank running;
* ``exit tail``: the head's launch returned minus the last rank's exit; ``tail_parts`` splits
  it (`testbed.simjob`): ``loop`` until the head saw every host done (of which ``reported``
  until the head read the last DONE off its stream: the simulated agents' work on these
  shared cores, in parallel on real hosts; ``seen`` until the head's loop had handled it),
  ``dismiss`` waiting for the agents not yet gone (each leaves at its DONE: BYE and EOF then),
  ``after`` closing the streams and the report;
* head CPU seconds and peak RSS (getrusage of the head's process), head CPU per host; the
  simulator processes' CPU, its system part and their context switches (``workers_use``:
  what the simulated agents' threads cost this machine, beside the head's own);
* frames through the head, both ways (every job with --heartbeat-interval 30: see
  `HEARTBEAT_S`), and the PMI bytes it sent (above 64 KiB of cards a fence's answer carries
  none: each get goes to the nearest level that holds the card, `launcher.pmi.kvs`).

Then each measure's growth with N (hosts) fitted by least squares as ``a + b N`` and as
``a + b N log2 N`` (residual RMS of each), and the targets at 1,024 x 8: launch + wire-up
< 10 s, exit tail < 1 s, head memory < 1 GiB.

Fidelity first: at 8 hosts x 8 ranks, real agent processes with real rank processes (playing
the same conversation, `testbed/simrank.py`) against the simulator: frames per kind (clocked
ones aside) equal, and the head's CPU ratio (target within 20%).

All of it runs on this machine: the agents' and fake ranks' CPU competes with the head's (2
cores here), so times are upper bounds for a head with a machine of its own; the head's CPU
seconds are its own. Each size runs flat (``--fanout 0``) and as a tree (``--fanout 32``, the
automatic default above 64 hosts: relays are real agents reaching their hosts over the
simulator's links), labelled ``flat`` and ``tree``.

Each in two address exchanges (`testbed.simrank`): ``light``, every rank puts a 200-character
card and reads 4 peers' (a program that wires up lazily); and ``mpich`` (rows ``... mpich``),
MPICH's default: each host's first rank puts its host's card (10 keys, 5 KB) and reads every
host's. Past the fence's push limit (`launcher.pmi.kvs.PUSH_BYTES`, 64 such hosts) a host's
first miss, a key of MPICH's all-gather, fetches every card at once (5.5 MB at 1,024 hosts,
1.3 MB compressed; no get goes up): N fetches of N cards, the exchange's N^2 bytes, through
the head flat (the same frame to every host) and through the relays in the tree. Its rows
read `MPICH_READS` hosts' cards (40 gets, all from the host's cache after its fetch), not all
N: the rest are the same work on every host in parallel, and simulating them (N^2 gets in
all) would take this machine's simulator minutes.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench import common
from testbed.simrank import EXCHANGES

SIZES = (256, 512, 1024, 4096)
#: Flat (``--fanout 0``: left to its default, a launch above 64 hosts fans out) and the tree
#: at the automatic fan-out (`launcher.tree.shape.AUTO_FANOUT`).
FANOUTS = (0, 32)
#: In MPICH's exchange, the hosts whose cards each host's first rank reads (see the module).
MPICH_READS = 4
PER_HOST = 8
FIDELITY_HOSTS = 8
CLOCKED = {"HEARTBEAT", "PROGRESS"}
FITTED = ("wired_s", "exit_tail_s", "head_cpu_s", "head_mib")
TARGETS = {"wired_s": 10.0, "exit_tail_s": 1.0, "head_mib": 1024.0}
TARGET_HOSTS = 1024
#: --heartbeat-interval of every simulated job: thousands of simulated hosts share this
#: machine's cores with everything else, and a starved simulator process must not make the
#: head count its hosts lost (15 s at the default 5 s); real hosts have cores of their own.
HEARTBEAT_S = 30.0
COLUMNS = [("mode", "mode"), ("hosts", "hosts"), ("ranks", "ranks"), ("ok", "ok"),
           ("joined s", "joined_s"), ("running s", "running_s"), ("fence s", "fence_s"),
           ("wired s", "wired_s"),
           ("exit tail s", "exit_tail_s"), ("head CPU s", "head_cpu_s"),
           ("CPU ms/host", "cpu_ms_per_host"), ("head MiB", "head_mib"),
           ("frames in", "frames_in"), ("frames out", "frames_out"),
           ("PMI MiB out", "pmi_mib_out"), ("load", "load"), ("wall s", "wall_s")]
SUMMARY_COLUMNS = COLUMNS
SUMMARY_NOTE = (
    "Simulated hosts share this machine with the head: their agents' and fake ranks' CPU "
    "competes with the head's, so times are upper bounds; the head's CPU and memory are its "
    "own. Rows `fit ...` give each measure's least-squares growth with N hosts "
    "(a + b N and a + b N log2 N, with the residual RMS of each); `fidelity` rows compare real "
    "agents and ranks with the simulator at 8 hosts.")


def _frames(result: dict[str, Any], direction: str) -> int:
    return sum(n for n, _ in result["frames"][direction].values())


def _row(result: dict[str, Any], mode: str, wall: float) -> dict[str, Any]:
    hosts, ranks = result["hosts"], result["hosts"] * result["ranks_per_host"]
    ok = (result["code"] == 0 and result["rank_codes"] == [0] and result["ranks_seen"] == ranks
          and result["wired"] is not None)
    pmi_out = sum(b for k, (_, b) in result["frames"]["out"].items() if k.startswith("PMI"))
    running = result["running"]
    fenced = result["fenced"]
    return {
        "mode": mode, "tool": f"dtrain {mode}", "hosts": hosts, "ranks": ranks, "reps": 1,
        "ok": "yes" if ok else "no",
        "joined_s": result.get("joined"), "running_s": running, "wired_s": result["wired"],
        "fence_s": round(fenced - running, 3) if fenced is not None and running else None,
        "exit_tail_s": result["exit_tail"], "tail_parts": result.get("tail_parts"),
        "head_cpu_s": result["head_cpu_s"],
        "cpu_ms_per_host": round(1000 * result["head_cpu_s"] / hosts, 2),
        "head_mib": result["head_maxrss_mib"], "frames_in": _frames(result, "in"),
        "frames_out": _frames(result, "out"), "pmi_mib_out": round(pmi_out / 2**20, 2),
        "frames": result["frames"], "load": round(os.getloadavg()[0], 1),
        "wall_s": round(wall, 1), "workers_cpu_s": result["workers_cpu_s"],
        "workers_use": result.get("workers_use"),
        **({} if ok else {"error": result["stderr_tail"][-400:]}),
    }


def fit(points: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """Least squares of y on N as a + b N and as a + b N log2 N: coefficients and residual
    RMS of each (the smaller residual says which growth the points follow)."""
    import numpy as np

    n = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    out: dict[str, Any] = {}
    for name, x in (("linear", n), ("nlogn", n * np.log2(n))):
        design = np.stack([np.ones_like(x), x], axis=1)
        (a, b), *_ = np.linalg.lstsq(design, y, rcond=None)
        rms = float(np.sqrt(np.mean((design @ np.array([a, b]) - y) ** 2)))
        out[name] = {"a": float(a), "b": float(b), "rms": rms}
    return out


def _fit_rows(rows: list[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    done = [r for r in rows if r["mode"] == mode and r["ok"] == "yes"]
    if len(done) < 2:
        return []
    out = []
    for key in FITTED:
        f = fit([(r["hosts"], r[key]) for r in done])
        lin, nln = f["linear"], f["nlogn"]
        at = {name: g["a"] + g["b"] * (TARGET_HOSTS if name == "linear" else
                                       TARGET_HOSTS * math.log2(TARGET_HOSTS))
              for name, g in f.items()}
        target = TARGETS.get(key)
        out.append({
            "mode": f"fit {mode}", "measure": key,
            "linear": f"{lin['a']:.4g} + {lin['b']:.4g} N (rms {lin['rms']:.3g})",
            "nlogn": f"{nln['a']:.4g} + {nln['b']:.4g} N log2 N (rms {nln['rms']:.3g})",
            "at_1024": round(at["linear"], 3),
            "target": target, "meets": None if target is None else at["linear"] < target,
            "points": len(done)})
    return out


def fidelity(hosts: int = FIDELITY_HOSTS, per_host: int = PER_HOST,
             extra: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Real agents and ranks vs the simulator at ``hosts``: frames per kind, head CPU."""
    from testbed import simjob

    rows = []
    results = {}
    for mode, real in (("real", True), ("sim", False)):
        t0 = time.monotonic()
        results[mode] = simjob.run_job(hosts, per_host, real=real, timeout=300, extra=extra,
                                       heartbeat=HEARTBEAT_S, idle=True)
        rows.append(_row(results[mode], f"fidelity {mode}", time.monotonic() - t0))
    real_c, sim_c = (_counted(results[m]) for m in ("real", "sim"))
    ratio = rows[1]["head_cpu_s"] / rows[0]["head_cpu_s"] if rows[0]["head_cpu_s"] else None
    rows.append({"mode": "fidelity sim/real", "tool": "sim/real", "reps": 1, "hosts": hosts,
                 "ranks": hosts * per_host,
                 "ok": "yes" if real_c == sim_c else "no",
                 "head_cpu_ratio": None if ratio is None else round(ratio, 3),
                 "frames_equal": real_c == sim_c,
                 **({} if real_c == sim_c else {"error": f"real {real_c} sim {sim_c}"})})
    return rows


def _counted(result: dict[str, Any]) -> dict[str, dict[str, int]]:
    return {d: {k: n for k, (n, _) in kinds.items() if k not in CLOCKED}
            for d, kinds in result["frames"].items()}


def run(sizes: Sequence[int] = SIZES, per_host: int = PER_HOST, *,
        fanouts: Sequence[int] = FANOUTS, exchanges: Sequence[str] = EXCHANGES,
        fidelity_hosts: int = FIDELITY_HOSTS, rendezvous: Sequence[int] = (1024,),
        budget_s: float = 900.0,
        progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Fidelity rows, then per exchange and fan-out in ``fanouts`` (0: flat, K: ``--fanout
    K``, the tree) one row per size and the fits, then rendezvous mode at ``rendezvous``
    sizes (the head listens, every simulated host joins it: token handshake, roster; its
    ``joined_s`` is when the last agent was admitted). A size whose wall time, extrapolated
    from the size before, exceeds ``budget_s`` is skipped, with the reason."""
    say = progress or (lambda line: None)
    rows = fidelity(fidelity_hosts, per_host, ("--fanout", "0")) if fidelity_hosts else []
    say(f"fidelity at {fidelity_hosts} hosts: {rows[-1] if rows else 'skipped'}")
    for exchange in exchanges:
        for fanout in fanouts:
            mode = ("tree" if fanout else "flat") + ("" if exchange == "light" else f" {exchange}")
            rows += _sizes(sizes, per_host, mode, ("--fanout", str(fanout)), budget_s, say,
                           rendezvous=False, exchange=exchange)
            rows += _fit_rows(rows, mode)
    return rows + _sizes(rendezvous, per_host, "rendezvous", (), budget_s, say,
                         rendezvous=True)


def _sizes(sizes: Sequence[int], per_host: int, mode: str, extra: Sequence[str],
           budget_s: float, say: Callable[[str], None], *,
           rendezvous: bool, exchange: str = "light") -> list[dict[str, Any]]:
    from testbed import simjob

    rows: list[dict[str, Any]] = []
    per_host_wall = 0.0
    for hosts in sizes:
        guess = per_host_wall * hosts
        if guess > budget_s:
            rows.append({"mode": mode, "tool": f"dtrain {mode}", "hosts": hosts, "reps": 0,
                         "ranks": hosts * per_host, "ok": "skipped",
                         "error": f"expected ~{guess:.0f}s of wall time (> {budget_s:.0f}s) "
                         f"from {per_host_wall * 1000:.0f}s per 1,000 hosts measured"})
            continue
        t0 = time.monotonic()
        try:
            reads = {"gets": MPICH_READS} if exchange == "mpich" else {}
            result = simjob.run_job(hosts, per_host, timeout=budget_s, extra=extra,
                                    heartbeat=HEARTBEAT_S, rendezvous=rendezvous,
                                    exchange=exchange, idle=True, **reads)
        except Exception as exc:  # noqa: BLE001 - a size that fails is a row, not the end
            rows.append({"mode": mode, "tool": f"dtrain {mode}", "hosts": hosts, "reps": 1,
                         "ranks": hosts * per_host, "ok": "no",
                         "error": f"{type(exc).__name__}: {str(exc)[-400:]}",
                         "wall_s": round(time.monotonic() - t0, 1)})
            continue
        wall = time.monotonic() - t0
        per_host_wall = wall / hosts
        rows.append(_row(result, mode, wall))
        say(f"{mode} {hosts} hosts: {({k: v for k, v in rows[-1].items() if k != 'frames'})}")
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    common.print_rows("The head at scale, simulated hosts (testbed.simcluster)",
                      [r for r in rows if not r["mode"].startswith(("fit", "fidelity sim"))],
                      COLUMNS)
    for r in rows:
        if r["mode"] == "fidelity sim/real":
            print(f"fidelity at {r['hosts']} hosts: frames per kind equal: {r['frames_equal']}; "
                  f"head CPU sim/real {r['head_cpu_ratio']}")
        elif r["mode"].startswith("fit"):
            print(f"{r['mode']} {r['measure']}: {r['linear']}; {r['nlogn']}; at 1,024 "
                  f"{r['at_1024']} (target {r['target']}: {r['meets']})")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sim_scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--per-host", type=int, default=PER_HOST)
    ap.add_argument("--fanouts", default=",".join(map(str, FANOUTS)),
                    help="0 flat, K the tree with --fanout K; comma-separated")
    ap.add_argument("--exchanges", default=",".join(EXCHANGES),
                    help="address exchanges the ranks play: light, mpich; comma-separated")
    ap.add_argument("--fidelity-hosts", type=int, default=FIDELITY_HOSTS)
    ap.add_argument("--rendezvous", default="1024", help="sizes in rendezvous mode ('' none)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    rows = run([int(s) for s in args.sizes.split(",")], args.per_host,
               fanouts=[int(k) for k in args.fanouts.split(",") if k],
               exchanges=[e for e in args.exchanges.split(",") if e],
               fidelity_hosts=args.fidelity_hosts,
               rendezvous=[int(n) for n in args.rendezvous.split(",") if n],
               progress=lambda line: print(line, flush=True))
    print_table(rows)
    if args.json:
        import json

        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
