"""A nested state (dicts, lists, numbers, strings and tensors, e.g. a torch optimizer's
``state_dict``) as tensors plus a JSON skeleton, and back: a checkpoint keeps the tensors in a
safetensors file and the skeleton in JSON, so reading it back unpickles nothing.

The skeleton is the state with every tensor replaced by ``{"tensor": key}``; a dict whose keys
are not all strings (a torch optimizer's per-parameter state is keyed by index) becomes
``{"items": [[key, value], ...]}`` so its keys come back with their type, and a tuple
``{"tuple": [...]}``.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.checkpoint.layout import CheckpointError

_MARKS = ("tensor", "items", "tuple")


def flatten(state: Any, prefix: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """(skeleton, tensors by key) of ``state``; keys start with ``prefix``."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            key = f"{prefix}{len(tensors)}"
            tensors[key] = value.detach().cpu().contiguous()
            return {"tensor": key}
        if isinstance(value, dict):
            if all(isinstance(k, str) and k not in _MARKS for k in value):
                return {k: walk(v) for k, v in value.items()}
            return {"items": [[k, walk(v)] for k, v in value.items()]}
        if isinstance(value, tuple):
            return {"tuple": [walk(v) for v in value]}
        if isinstance(value, list):
            return [walk(v) for v in value]
        if value is None or isinstance(value, bool | int | float | str):
            return value
        raise CheckpointError("checkpoint save failed", type(value).__name__,
                              "a state to save holds a value that is neither a tensor nor "
                              "plain data", "Save only tensors, numbers, strings, lists and "
                              "dicts")  # a programming error of the state's owner

    return walk(state), tensors


def unflatten(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The state `flatten` took apart."""
    if isinstance(skeleton, list):
        return [unflatten(v, tensors) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    if skeleton.keys() == {"tensor"}:
        return tensors[skeleton["tensor"]]
    if skeleton.keys() == {"items"}:
        return {k: unflatten(v, tensors) for k, v in skeleton["items"]}
    if skeleton.keys() == {"tuple"}:
        return tuple(unflatten(v, tensors) for v in skeleton["tuple"])
    return {k: unflatten(v, tensors) for k, v in skeleton.items()}
