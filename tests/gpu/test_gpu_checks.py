"""Runs tests/gpu/check_sglang.py where it can run: a CUDA GPU and sglang installed.

One case per target: the shrunken Llama, and the shrunken Kimi-K2.5 in its shipping layout
(``KimiK25ForConditionalGeneration`` wrapper, remote-code tiktoken tokenizer, MLA).
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CHECK = Path(__file__).with_name("check_sglang.py")


def _has_cuda_and_sglang() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:  # the distribution: tests/sglang/ is importable as a namespace package
        importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return False
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(not _has_cuda_and_sglang(), reason="needs a CUDA GPU and sglang")
@pytest.mark.parametrize("model", ["llama", "kimi-wrapper"])
def test_sglang_capture_matches_transformers_on_gpu(model: str) -> None:
    result = subprocess.run(
        [sys.executable, str(CHECK), "--model", model],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    print(result.stdout, result.stderr[-5000:])
    assert result.returncode == 0, result.stdout
    assert "PASS" in result.stdout
