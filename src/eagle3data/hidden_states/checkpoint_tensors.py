"""Single tensors read straight from a checkpoint's files (safetensors or ``.bin``), without
building the model: the agreement check needs the output head, the final-state conversion
the final norm, where the whole of Kimi-K2.5 is a terabyte."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import ModelConfigError


def weight_files(model_dir: Path, needed_for: str) -> dict[str, Path]:
    """Checkpoint tensor name -> file, from the index when there is one. ``needed_for`` ends
    the error where there is no weight file ("to read the lm_head from (...)")."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = model_dir / index_name
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: model_dir / file for name, file in weight_map.items()}
    for single in ("model.safetensors", "pytorch_model.bin"):
        path = model_dir / single
        if path.is_file():
            return dict.fromkeys(_tensor_names(path), path)
    raise ModelConfigError(
        f"{model_dir}: no model.safetensors(.index.json) or pytorch_model.bin(.index.json) "
        f"{needed_for}"
    )


def _tensor_names(path: Path) -> list[str]:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    return list(torch.load(path, map_location="cpu", mmap=True, weights_only=True))


def read_tensor(path: Path, name: str) -> torch.Tensor:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            return f.get_tensor(name)
    return torch.load(path, map_location="cpu", mmap=True, weights_only=True)[name]
