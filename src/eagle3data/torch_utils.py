"""Small torch helpers shared by the in-process engines."""

from __future__ import annotations

from typing import Any

import torch

from .model_config import resolve_dtype_name

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, model_config: Any) -> torch.dtype:
    """``auto`` means the dtype the checkpoint declares (float32 if it declares none)."""
    return TORCH_DTYPES[resolve_dtype_name(name, model_config)]


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in TORCH_DTYPES.items()}[dtype]


def set_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)
