"""Pick the hidden-state backend named by ``hidden_states.backend``.

Every backend has the interface of :class:`eagle3data.extract.HiddenStateExtractor`:
attributes ``aux``, ``hidden_size``, ``dtype`` and ``forward(samples)`` returning
``(aux [T, 3H], last [T, H])`` CPU tensors per sample in the model dtype.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from .gpu_slots import VISIBLE_ENV, held_gpu_count, parse_visible
from .settings import hidden_state_dtype

BACKENDS = ("transformers", "sglang")


def job_gpu_count() -> int:
    """GPUs this job spreads a transformers model over: as many as it asked the slot
    lock for (a scheduler may show more), else all visible ones, else one device."""
    held = held_gpu_count()
    if held is not None:
        return held
    visible = os.environ.get(VISIBLE_ENV)
    return len(parse_visible(visible)) if visible is not None else 1


def build_extractor(
    model_path: str,
    hidden_cfg: Mapping[str, Any],
    model_dtype: str,
    *,
    sglang_engine_factory: Callable[[Mapping[str, Any]], Any] | None = None,
) -> Any:
    backend = hidden_cfg.get("backend", "transformers")
    common: dict[str, Any] = {
        "aux_layers": hidden_cfg["aux_layers"],
        "convention": hidden_cfg["aux_layer_convention"],
        "dtype": hidden_state_dtype(hidden_cfg, model_dtype),
    }
    if backend == "transformers":
        from .extract import HiddenStateExtractor

        return HiddenStateExtractor(
            model_path, device=hidden_cfg["device"], gpus=job_gpu_count(), **common
        )
    if backend == "sglang":
        from .sglang_capture import SGLangCapture, start_engine

        return SGLangCapture(
            model_path,
            options=hidden_cfg.get("sglang") or {},
            engine_factory=sglang_engine_factory or start_engine,
            **common,
        )
    raise ValueError(f"hidden_states.backend must be one of {list(BACKENDS)}, got {backend!r}")
