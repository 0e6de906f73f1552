"""Small torch helpers shared by the in-process engines."""

from __future__ import annotations

from pathlib import Path
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


def load_causal_lm(path: str | Path, *, dtype: str, device: str, gpus: int = 1) -> tuple[Any, Any]:
    """Load (model, tokenizer) from a local directory, eval mode, no hub access.

    ``gpus > 1`` spreads the layers over every visible GPU (``device_map="auto"``,
    accelerate), for a target larger than one GPU; the GPU slot lock has already
    made only this job's GPUs visible.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    torch_dtype = resolve_dtype(dtype, config)
    if gpus > 1 and resolve_device(device).type == "cuda":
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, local_files_only=True, device_map="auto"
        ).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True)
        model.to(resolve_device(device)).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer
