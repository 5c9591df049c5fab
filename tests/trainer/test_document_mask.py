"""Document masking (``--document-mask``, `trainer.model.documents`) on one process: what it
means, and how the data loader hands it over.

- The masked model on a window of packed documents computes what the same model computes on
  each document alone, as a sequence of its own (at the same rotary positions: positions stay
  global), for the GPT and the Llama (grouped-query attention): logits, loss and every
  gradient. Without the mask the window's documents see each other, and the results differ by
  far more than rounding. Both sides are fp64 and differ only in the order of sums (the masked
  keys add exact zeros), bounded as in `tests.trainer.test_llama_tp`: `reduction_rtol` of the
  longest sum, relative to the largest element.
- The loader gives each microbatch its windows' document ids, counted on the whole window: a
  context-parallel rank's ``keep`` cuts tokens and targets, never the ids.
- A blend whose datasets end documents with different ids is refused, naming them.
- ``python -m trainer.train --document-mask`` trains and evaluates on a packed dataset as a
  user runs it (the validation batches carry their document ids too).
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from tests.support import PYTHON, REPO, dtrain_env
from tests.support.documents import EOS, write_documents
from tests.support.numerics import float64, reduction_rtol
from trainer.config.options import make_config
from trainer.data.batches import BatchPlan
from trainer.data.corpus import DataError
from trainer.data.token_batches import TokenBatches
from trainer.data.token_files import MANIFEST
from trainer.model.documents import document_ids
from trainer.model.family import build_model
from trainer.model.gpt import GPT, cross_entropy
from trainer.parallel.context import SequenceLayout
from trainer.training.metrics import read_records

B, T = 2, 32
FAMILIES = {"gpt": {"model": "tiny", "seq_len": T}, "llama": {"model": "llama-tiny", "seq_len": T}}
EOS_AT = [[5, 6, 20], [0, 31]]
"""Where each sample's documents end: a one-token document (6), a window that starts with an
EOS (so its first document is one token), a sample ending on one."""


def test_each_token_counts_the_ends_of_documents_before_it() -> None:
    tokens = torch.tensor([[5, 0, 7, 0, 0, 3], [1, 2, 3, 4, 5, 6]])
    assert document_ids(tokens, 0).tolist() == [[0, 0, 1, 1, 2, 3], [0, 0, 0, 0, 0, 0]]


def window(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(1, vocab, (B, T + 1), generator=g)
    for row, ends in enumerate(EOS_AT):
        tokens[row, ends] = EOS
    return tokens[:, :-1], tokens[:, 1:]


def each_document_alone(model: GPT, x: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, V) of every document run as a sequence of its own, at the rotary
    positions it has in the window."""
    parts = []
    for row in range(B):
        for doc in docs[row].unique().tolist():
            at = (docs[row] == doc).nonzero().flatten()
            start, stop = int(at[0]), int(at[-1]) + 1
            h = model.embed(x[row:row + 1, start:stop])
            for block in model.blocks.values():
                h = block(h, model.rope_cos[start:stop], model.rope_sin[start:stop])
            parts.append(model.logits(h))
    return torch.cat(parts, dim=1).unflatten(1, (B, T)).squeeze(0)


def loss_and_grads(model: GPT, logits: torch.Tensor, y: torch.Tensor
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_masked_window_computes_each_document_as_a_sequence_of_its_own(family: str
                                                                            ) -> None:
    with float64():
        cfg = make_config({}, FAMILIES[family]).gpt
        model = build_model(cfg, seed=3)
        x, y = window(cfg.vocab_size)
        docs = document_ids(x, EOS)
        alone = each_document_alone(model, x, docs)
        masked = model(x, docs)
        causal = model(x)
    longest = B * T + cfg.hidden  # tokens into a weight gradient, + the MLP width
    rtol = reduction_rtol(longest)
    scale = float(alone.detach().abs().max())
    torch.testing.assert_close(masked, alone, rtol=0, atol=rtol * scale * longest)
    assert float((causal - alone).detach().abs().max()) > 1e6 * rtol * scale * longest
    want_loss, want = loss_and_grads(model, alone, y)
    got_loss, got = loss_and_grads(model, masked, y)
    assert float(got_loss) == pytest.approx(float(want_loss), rel=rtol, abs=0)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=0,
                                   atol=rtol * float(grad.abs().max()) * longest, msg=name)


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_documents(tmp_path_factory.mktemp("docs") / "ds", 4000)


def batches(data: Path, **options: object) -> TokenBatches:
    return TokenBatches([(data, 1.0)], seq_len=T, plan=BatchPlan(4, 1, 2), seed=1, dp_rank=0,
                        model_vocab=256, **options)  # type: ignore[arg-type]


def test_every_microbatch_carries_the_document_ids_of_its_whole_windows(packed: Path) -> None:
    plain = batches(packed).microbatches(1)
    masked = batches(packed, documents=True).microbatches(1)
    layout = SequenceLayout(T, 2)
    cut = batches(packed, documents=True, keep=lambda t: layout.split_tensor(t, 1)
                  ).microbatches(1)
    assert [len(m) for m in plain] == [2, 2] and [len(m) for m in masked] == [3, 3]
    for (x, y), (mx, my, docs), (cx, cy, cdocs) in zip(plain, masked, cut, strict=True):
        assert torch.equal(mx, x) and torch.equal(my, y)
        assert torch.equal(docs, document_ids(x, EOS)) and int(docs.max()) >= 2
        assert torch.equal(cx, layout.split_tensor(x, 1))
        assert torch.equal(cy, layout.split_tensor(y, 1)) and torch.equal(cdocs, docs)
    validation = batches(packed, documents=True, validation=True, val_fraction=0.1)
    assert all(len(m) == 3 for m in validation.microbatches(0))


def test_a_blend_that_ends_documents_with_different_ids_is_refused(packed: Path,
                                                                    tmp_path: Path) -> None:
    other = write_documents(tmp_path / "other", 4000, seed=1)
    manifest = json.loads((other / MANIFEST).read_text())
    manifest["eos_id"] = 7
    (other / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DataError) as err:
        TokenBatches([(packed, 1.0), (other, 1.0)], seq_len=T, plan=BatchPlan(4, 1, 2),
                     seed=1, dp_rank=0, model_vocab=256, documents=True)
    assert str(err.value).startswith("no single end-of-document token [--document-mask --data [")
    assert f"{other}: 7" in str(err.value)


def test_a_run_with_document_masking_trains_and_evaluates(packed: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [PYTHON, "-m", "trainer.train", "--model", "llama-tiny", "--seq-len", str(T),
         "--global-batch", "4", "--steps", "2", "--warmup-steps", "1", "--eval-every", "2",
         "--eval-batches", "1", "--log-every", "1", "--data", str(packed), "--document-mask",
         "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, cwd=REPO, env=dtrain_env(), timeout=300, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    records = read_records(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert math.isfinite(records[-1]["val_loss"])
