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


OP_S = 10e-6
"""Host seconds per tensor operation of eager PyTorch on a GPU: Python, autograd, the ATen
dispatcher and the kernel launch, about 5-25 us of CPU per operation ("From PyTorch op to
kernel launch", jiahuanglin.xyz/all_lessons/gpu_kernel_serving/18_pytorch_to_kernel.html).
The planner's `trainer.plan.operations` counts the operations."""


@dataclass(frozen=True)
class GPU:
    """One accelerator model."""

    memory_bytes: int
    """Memory one rank may use."""
    peak_flops: float
    """Dense bf16 peak, FLOP/s."""
    memory_bw: float = 0.0
    """Bytes/s between the device and its memory, the bound of the operations that are not
    matrix products (0: not described, their bytes are not priced)."""
    op_s: float = 0.0
    """Host seconds per tensor operation (dispatch and launch; `OP_S` for the GPUs by name;
    a CPU's measured by `trainer.plan.operations.op_seconds`)."""
    host_overlaps: bool = True
    """Whether the device computes while its host issues the next operations (a GPU: the
    step's compute is the longer of the two), or the host is the device (a CPU: they add)."""


GPUS: dict[str, GPU] = {
    "h100": GPU(80 * GIB, 989e12, 3.35e12, OP_S),
    "h200": GPU(141 * GIB, 989e12, 4.8e12, OP_S),
    "a100-80g": GPU(80 * GIB, 312e12, 2.039e12, OP_S),
    "a100-40g": GPU(40 * GIB, 312e12, 1.555e12, OP_S),
    "l40s": GPU(48 * GIB, 362e12, 0.864e12, OP_S),
}
"""Known GPUs (H100/H200 SXM, A100 SXM, L40S: NVIDIA data sheets, dense bf16, memory
bandwidth)."""

LINKS: dict[str, tuple[float, float]] = {
    "h100": (450e9, 50e9), "h200": (450e9, 50e9), "a100-80g": (300e9, 25e9),
    "a100-40g": (300e9, 25e9), "l40s": (32e9, 25e9),
}
"""Default (inside a host, between hosts) bandwidth per GPU and direction, bytes/s: NVLink 4/3
halved for one direction, PCIe 4 for the L40S, one 400/200 Gb/s NIC per GPU between hosts."""

LATENCIES: dict[str, tuple[float, float]] = {
    "h100": (3.4e-6, 14e-6), "h200": (3.4e-6, 14e-6), "a100-80g": (3.4e-6, 14e-6),
    "a100-40g": (3.4e-6, 14e-6), "l40s": (5.7e-6, 14e-6),
}
"""Default (inside a host, between hosts) seconds per message step of a collective: NCCL's own
tuning model for its ring algorithm and Simple protocol (``hwLat`` in NCCL's
src/graph/tuning.cc: NVLink 3.4 us, PCI 5.7 us, network 14 us per step)."""


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
    intra_latency_s: float = 0.0
    """Seconds per message step of a collective inside a host (a ring all-reduce of n
    members takes 2(n-1) steps, a send one)."""
    inter_latency_s: float = 0.0
    """Seconds per message step between hosts."""

    @property
    def gpus(self) -> int:
        return self.hosts * self.gpus_per_host

    def bandwidth(self, span: int) -> float:
        """The bandwidth of a group whose members lie ``span`` ranks apart at most: inside a
        host while it fits one, else between hosts (the slowest link of a ring)."""
        return self.intra_bw if span <= self.gpus_per_host else self.inter_bw

    def latency(self, span: int) -> float:
        """Seconds per message step of a group whose members lie ``span`` ranks apart."""
        return self.intra_latency_s if span <= self.gpus_per_host else self.inter_latency_s


def make_cluster(*, hosts: int, gpus_per_host: int, gpu: str = "", memory_gib: float = 0.0,
                 tflops: float = 0.0, intra_gbps: float = 0.0, inter_gbps: float = 0.0,
                 memory_gbps: float = 0.0, op_us: float = -1.0, intra_latency_us: float = -1.0,
                 inter_latency_us: float = -1.0, host_overlaps: bool = True) -> Cluster:
    """A cluster from a GPU name and/or numbers (numbers win over the name's; a negative
    time: the name's, 0 for a GPU given by numbers)."""
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
    base = known or GPU(0, 0.0)
    device = GPU(int(memory_gib * GIB) if memory_gib > 0 else base.memory_bytes,
                 tflops * 1e12 if tflops > 0 else base.peak_flops,
                 memory_gbps * 1e9 if memory_gbps > 0 else base.memory_bw,
                 op_us * 1e-6 if op_us >= 0 else base.op_s, host_overlaps)
    latencies = LATENCIES.get(gpu.lower(), (0.0, 0.0)) if gpu else (0.0, 0.0)
    return Cluster(hosts, gpus_per_host, device, intra, inter, gpu.lower() or "custom",
                   intra_latency_us * 1e-6 if intra_latency_us >= 0 else latencies[0],
                   inter_latency_us * 1e-6 if inter_latency_us >= 0 else latencies[1])
