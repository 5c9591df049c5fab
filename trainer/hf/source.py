"""What a run started with ``--init-from-hf DIR`` keeps of the folder besides its weights: its
tokenizer and the facts an export must give back.

The run's token ids are the folder's tokenizer's, so the run keeps it: ``tokenizer.json`` (and
``tokenizer_config.json``, ``special_tokens_map.json`` when present) are copied into the run dir,
where ``trainer.generate`` encodes and decodes with it and ``trainer.export`` writes it out (as
it does for a run on tokenized data). ``hf_source.json`` records the folder's special ids (BOS,
EOS, from its ``config.json``: the tokenizer's names for them vary by family) and its
``max_position_embeddings``: a run trains at its own ``--seq-len``, but the model it exports is
still the source's, made for that many positions.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.hf.config import HFError
from trainer.hf.folder import TOKENIZER_FILES

SOURCE = "hf_source.json"


@dataclass(frozen=True)
class Source:
    """The facts of the imported folder an export gives back (None: the folder had none)."""

    bos_token_id: int | None = None
    eos_token_id: int | None = None
    max_position_embeddings: int | None = None

    @classmethod
    def of_config(cls, hf: dict[str, Any]) -> Source:
        """From the folder's ``config.json`` (a list of EOS ids keeps the first)."""
        def one(key: str) -> int | None:
            value = hf.get(key)
            value = value[0] if isinstance(value, list) and value else value
            return value if type(value) is int else None
        return cls(one("bos_token_id"), one("eos_token_id"), one("max_position_embeddings"))


def keep(folder: Path, run_dir: Path) -> None:
    """Copy the tokenizer of the Hugging Face ``folder`` into ``run_dir`` and record its
    `Source` there (each file replaced atomically: a resumed run writes the same)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            _replace(run_dir / name, (folder / name).read_bytes())
    hf = json.loads((folder / "config.json").read_text())  # read and checked at start-up
    source = Source.of_config(hf)
    _replace(run_dir / SOURCE, json.dumps(source.__dict__, indent=1).encode())


def read(run_dir: Path) -> Source | None:
    """The `Source` a run kept (None: the run did not start from a Hugging Face folder)."""
    path = run_dir / SOURCE
    if not path.is_file():
        return None
    try:
        return Source.of_config(json.loads(path.read_text()))
    except (OSError, ValueError, AttributeError) as err:
        raise HFError("unreadable record of the imported folder", str(path), str(err),
                      "Delete it to export without the source's special ids") from None


def _replace(target: Path, data: bytes) -> None:
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, target)

