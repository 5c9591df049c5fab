"""Per-device settings of the GPU path, checked on a CPU: TF32 only for fp32 CUDA runs, the
AdamW kernel per device, a CPU run keeping the memory it frees, and ``--compile``'s two
outcomes (compiled blocks that compute what eager ones do, and a failing compiler that leaves
eager blocks and one message).

The compile tests use torch.compile's ``aot_eager`` backend (dynamo and AOTAutograd, the parts
shared with inductor) and a backend that raises: inductor itself needs minutes of C++ builds on
this 2-core host, which `tests/trainer/test_gpu.py` and ``python -m bench.gpu`` run on a GPU.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from tests.support import REPO
from trainer.gpu.compile import compile_blocks
from trainer.gpu.settings import adamw_kernel, configure_matmul, keep_freed_memory
from trainer.model.config import GPTConfig
from trainer.model.gpt import GPT
from trainer.optim.optimizer import build_optimizer

CFG = GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8)


@pytest.fixture
def matmul_precision() -> Iterator[None]:
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


def test_fp32_cuda_runs_use_tf32_matmuls(matmul_precision: None) -> None:
    assert configure_matmul(torch.device("cuda", 0), "fp32") == "tf32 matmuls"
    assert torch.get_float32_matmul_precision() == "high"


@pytest.mark.parametrize("device,precision", [("cpu", "fp32"), ("cpu", "bf16"), ("cuda", "bf16")])
def test_cpu_and_bf16_runs_keep_full_fp32_matmuls(matmul_precision: None, device: str,
                                                   precision: str) -> None:
    torch.set_float32_matmul_precision("highest")
    assert configure_matmul(torch.device(device), precision) == ""
    assert torch.get_float32_matmul_precision() == "highest"


def test_adamw_runs_the_fused_kernel_on_a_cpu() -> None:
    model = GPT(CFG)
    assert adamw_kernel(list(model.parameters())) == {"fused": True}
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    assert optimizer.defaults["fused"] is True


def test_adamw_takes_the_per_tensor_loop_where_no_fused_kernel_takes_the_parameters() -> None:
    assert adamw_kernel([torch.zeros(2, device="meta")]) == {"foreach": False}
    assert adamw_kernel([torch.zeros(2), torch.zeros(2, device="meta")]) == {"foreach": False}


def test_fused_adamw_steps_an_element_alike_however_the_parameters_are_split() -> None:
    """What lets ZeRO-1's flat-buffer pieces step exactly as whole parameters do."""
    gen = torch.Generator().manual_seed(3)
    weights, grads = (torch.randn(1031, generator=gen, dtype=torch.float64) for _ in "wg")

    def stepped(sizes: list[int]) -> torch.Tensor:
        parts = [torch.nn.Parameter(w.clone()) for w in torch.split(weights, sizes)]
        optimizer = torch.optim.AdamW(parts, lr=1e-2, weight_decay=0.1, **adamw_kernel(parts))
        for k in range(3):
            for p, g in zip(parts, torch.split(grads, sizes), strict=True):
                p.grad = g * (k + 1)
            optimizer.step()
        return torch.cat([p.detach() for p in parts])

    assert torch.equal(stepped([1031]), stepped([5, 512, 17, 497]))


def _loss_and_grads(model: GPT) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    x, y = (torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=gen) for _ in "xy")
    model.zero_grad()
    loss = model.loss(x, y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_compiled_blocks_compute_what_the_eager_blocks_compute() -> None:
    eager, compiled = GPT(CFG, seed=2), GPT(CFG, seed=2)
    assert compile_blocks(compiled, 2, backend="aot_eager")
    assert all("forward" in block.__dict__ for block in compiled.blocks.values())
    assert compiled.state_dict().keys() == eager.state_dict().keys()  # checkpoints unchanged
    loss, grads = _loss_and_grads(compiled)
    want_loss, want_grads = _loss_and_grads(eager)
    torch.testing.assert_close(loss, want_loss)  # fp32 tolerance: another op order
    torch.testing.assert_close(grads, want_grads)


def _no_compiler(gm: torch.fx.GraphModule, inputs: list) -> None:
    raise RuntimeError("no C++ compiler on this host")


def test_a_compiler_that_fails_leaves_eager_blocks_and_says_so_once(
        capsys: pytest.CaptureFixture[str]) -> None:
    model = GPT(CFG, seed=2)
    assert not compile_blocks(model, 2, backend=_no_compiler)
    assert not any("forward" in block.__dict__ for block in model.blocks.values())
    said = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(said) == 1, said
    assert said[0].startswith("dtrain: --compile failed [rank 0, torch.compile _no_compiler]: ")
    assert "no C++ compiler on this host" in said[0]
    assert "Training continues with eager blocks on every rank" in said[0]
    loss, grads = _loss_and_grads(model)  # trains as the eager model
    want_loss, want_grads = _loss_and_grads(GPT(CFG, seed=2))
    assert torch.equal(loss, want_loss) and all(map(torch.equal, grads, want_grads))


FAULTS = """
import resource, torch
from trainer.gpu.settings import keep_freed_memory

def faults_per_step() -> float:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):  # a 64 MiB activation made and freed, as each step does
        torch.empty(16 << 20).fill_(1.0)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20

before = faults_per_step()
kept = keep_freed_memory(torch.device("cpu"))
faults_per_step()  # the first steps grow the heap: its pages are new once
print(before, kept, faults_per_step())
"""


def test_a_cpu_run_reuses_the_memory_its_steps_free_instead_of_faulting_it_in_again() -> None:
    done = subprocess.run([sys.executable, "-c", FAULTS], capture_output=True, text=True,
                          check=True, cwd=REPO)
    before, kept, after = done.stdout.split()
    assert kept == "True", done.stdout
    # 64 MiB is 16,384 pages: glibc maps a block that large afresh every time by default.
    assert float(before) > 8000 and float(after) < 100, done.stdout


def test_other_devices_keep_the_c_library_defaults() -> None:
    assert keep_freed_memory(torch.device("meta")) is False
