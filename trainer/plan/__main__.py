"""Which layouts of a model fit a cluster, and which runs fastest:

    python -m trainer.plan --hosts 4 --gpus-per-host 8 --gpu h100 --model llama3-8b \\
        --seq-len 8192 --global-batch 256
    python -m trainer.plan --hosts 1 --gpus-per-host 8 --gpu a100-80g \\
        --hf-config path/to/config.json --global-batch 64 --json

The model and the run are given with `python -m trainer.train`'s own flags (any of them: model
preset and fields, --global-batch, --precision, --schedule, ...), or a Hugging Face Llama
config.json; the layout options (--dp --tp --pp --cp --ep --zero --recompute
--sequence-parallel --microbatches) are what the plan searches (--cp-comm, --zero-shard-size
and --zero-prefetch are taken as given).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SEARCHED = ("dp", "tp", "pp", "cp", "ep", "zero", "recompute", "sequence_parallel",
            "microbatches")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m trainer.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    c = ap.add_argument_group("cluster")
    c.add_argument("--hosts", type=int, default=1, help="hosts (nodes)")
    c.add_argument("--gpus-per-host", type=int, default=8, help="GPUs per host")
    c.add_argument("--gpu", default="", help="a known GPU: h100, h200, a100-80g, a100-40g, l40s")
    c.add_argument("--gpu-memory-gib", type=float, default=0.0,
                   help="memory per GPU in GiB (instead of, or overriding, --gpu's)")
    c.add_argument("--gpu-tflops", type=float, default=0.0,
                   help="peak TFLOP/s per GPU at the run's precision (overrides --gpu's)")
    c.add_argument("--intra-gbps", type=float, default=0.0,
                   help="GB/s one GPU sends to another of its host")
    c.add_argument("--inter-gbps", type=float, default=0.0,
                   help="GB/s one GPU sends to a GPU of another host")
    c.add_argument("--gpu-memory-gbps", type=float, default=0.0,
                   help="GB/s between a GPU and its memory (overrides --gpu's)")
    c.add_argument("--op-us", type=float, default=-1.0,
                   help="host microseconds per tensor operation (default: --gpu's, 10)")
    c.add_argument("--intra-latency-us", type=float, default=-1.0,
                   help="microseconds per message step inside a host (default: --gpu's)")
    c.add_argument("--inter-latency-us", type=float, default=-1.0,
                   help="microseconds per message step between hosts (default: --gpu's)")
    p = ap.add_argument_group("plan")
    p.add_argument("--hf-config", default="", help="a Hugging Face Llama config.json as the model")
    p.add_argument("--efficiency", type=float, default=0.5,
                   help="fraction of peak FLOP/s the model's matrix products reach (cost model)")
    p.add_argument("--top", type=int, default=15, help="layouts to print")
    p.add_argument("--json", action="store_true", help="print every layout as JSON")
    return ap


def _model_flags(path: str) -> dict[str, Any]:
    """The trainer's model options of a Hugging Face config.json."""
    from trainer.config.options import OPTIONS
    from trainer.errors import ConfigError
    from trainer.hf.config import from_hf_config

    try:
        hf = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError("cannot read the model's config", f"--hf-config {path}", str(exc),
                          "Give the config.json of a Hugging Face Llama folder") from None
    if not isinstance(hf, dict):
        raise ConfigError("cannot read the model's config", f"--hf-config {path}",
                          "it is not a JSON object", "Give a Hugging Face config.json")
    gpt = from_hf_config(hf, path)
    flags: dict[str, Any] = {}
    for flag, opt in OPTIONS.items():
        if opt.path[:2] == ("model", "gpt"):
            value: Any = gpt
            for name in opt.path[2:]:
                value = getattr(value, name)
            flags[flag] = value
    return flags


def main(argv: Sequence[str] | None = None) -> int:
    from trainer.config.flags import build_parser
    from trainer.config.options import TrainConfig
    from trainer.errors import TrainerError
    from trainer.plan.cluster import make_cluster
    from trainer.plan.estimate import plan
    from trainer.plan.report import as_json, as_table

    args, rest = _parser().parse_known_args(argv)
    run = build_parser(TrainConfig, prog="python -m trainer.plan (training flags)",
                       description="").parse_args(rest)
    try:
        base = {**(_model_flags(args.hf_config) if args.hf_config else {}),
                **{k: v for k, v in vars(run).items() if k not in SEARCHED}}
        cluster = make_cluster(hosts=args.hosts, gpus_per_host=args.gpus_per_host,
                               gpu=args.gpu, memory_gib=args.gpu_memory_gib,
                               tflops=args.gpu_tflops, intra_gbps=args.intra_gbps,
                               inter_gbps=args.inter_gbps, memory_gbps=args.gpu_memory_gbps,
                               op_us=args.op_us, intra_latency_us=args.intra_latency_us,
                               inter_latency_us=args.inter_latency_us)
        done, refused = plan(base, cluster, efficiency=args.efficiency)
    except TrainerError as exc:
        print(f"dtrain plan: {exc}", file=sys.stderr)
        return 2
    if not done:
        reasons = sorted({str(r) for r in refused})[:3]
        print("dtrain plan: no layout of the trainer's fits these GPUs: "
              + "; ".join(reasons), file=sys.stderr)
        return 1
    print(as_json(done, refused, cluster) if args.json else
          as_table(done, refused, cluster, top=args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
