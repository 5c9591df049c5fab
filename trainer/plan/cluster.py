"""The cluster a plan is for: hosts, GPUs per host, each GPU's memory and peak FLOP/s, and the
bandwidth inside a host and between hosts.

GPUs by name come from vendors' data sheets (dense bf16 peak; memory as the device reports it);
any of them can be replaced by numbers (``--gpu-memory-gib``, ``--gpu-tflops``), and a CPU is
described by what was measured on it (`trainer.plan` docs: the CPU row of the performance page).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.errors import ConfigError

GIB = 2**30


@dataclass(frozen=True)
class GPU:
    """One accelerator model."""

    memory_bytes: int
    """Memory one rank may use."""
    peak_flops: float
    """Dense bf16 peak, FLOP/s."""


GPUS: dict[str, GPU] = {
    "h100": GPU(80 * GIB, 989e12),
    "h200": GPU(141 * GIB, 989e12),
    "a100-80g": GPU(80 * GIB, 312e12),
    "a100-40g": GPU(40 * GIB, 312e12),
    "l40s": GPU(48 * GIB, 362e12),
}
"""Known GPUs (H100/H200 SXM, A100 SXM, L40S: NVIDIA data sheets, dense bf16)."""

LINKS: dict[str, tuple[float, float]] = {
    "h100": (450e9, 50e9), "h200": (450e9, 50e9), "a100-80g": (300e9, 25e9),
    "a100-40g": (300e9, 25e9), "l40s": (32e9, 25e9),
}
"""Default (inside a host, between hosts) bandwidth per GPU and direction, bytes/s: NVLink 4/3
halved for one direction, PCIe 4 for the L40S, one 400/200 Gb/s NIC per GPU between hosts."""


@dataclass(frozen=True)
class Cluster:
    """What the plan may use."""

    hosts: int
    """Hosts (nodes)."""
    gpus_per_host: int
    """GPUs (ranks) per host."""
    gpu: GPU
    """Each GPU."""
    intra_bw: float
    """Bytes/s one GPU sends to another of its host."""
    inter_bw: float
    """Bytes/s one GPU sends to a GPU of another host."""
    name: str = "custom"
    """The GPU's name, or "custom"."""

    @property
    def gpus(self) -> int:
        return self.hosts * self.gpus_per_host

    def bandwidth(self, span: int) -> float:
        """The bandwidth of a group whose members lie ``span`` ranks apart at most: inside a
        host while it fits one, else between hosts (the slowest link of a ring)."""
        return self.intra_bw if span <= self.gpus_per_host else self.inter_bw


def make_cluster(*, hosts: int, gpus_per_host: int, gpu: str = "", memory_gib: float = 0.0,
                 tflops: float = 0.0, intra_gbps: float = 0.0, inter_gbps: float = 0.0
                 ) -> Cluster:
    """A cluster from a GPU name and/or numbers (numbers win over the name's)."""
    where = f"--gpu {gpu}" if gpu else "--gpu-memory-gib/--gpu-tflops"
    if hosts < 1 or gpus_per_host < 1:
        raise ConfigError("cannot plan for this cluster", f"--hosts {hosts} --gpus-per-host "
                          f"{gpus_per_host}", "both must be at least 1", "Give positive counts")
    known = GPUS.get(gpu.lower()) if gpu else None
    if gpu and known is None:
        raise ConfigError("unknown GPU", where, "known GPUs: " + ", ".join(GPUS),
                          "Pick one, or describe it with --gpu-memory-gib and --gpu-tflops")
    if known is None and (memory_gib <= 0 or tflops <= 0):
        raise ConfigError("no GPU described", where, "the plan needs each GPU's memory and "
                          "peak FLOP/s", "Name a GPU (--gpu h100) or give both numbers")
    links = LINKS.get(gpu.lower(), (0.0, 0.0)) if gpu else (0.0, 0.0)
    intra = intra_gbps * 1e9 if intra_gbps > 0 else links[0]
    inter = inter_gbps * 1e9 if inter_gbps > 0 else links[1]
    if intra <= 0 or inter <= 0:
        raise ConfigError("no link bandwidth", where, "a GPU given by numbers has no default "
                          "links", "Give --intra-gbps and --inter-gbps (GB/s per GPU)")
    device = GPU(int(memory_gib * GIB) if memory_gib > 0 else known.memory_bytes,  # type: ignore[union-attr]
                 tflops * 1e12 if tflops > 0 else known.peak_flops)  # type: ignore[union-attr]
    return Cluster(hosts, gpus_per_host, device, intra, inter, gpu.lower() or "custom")
