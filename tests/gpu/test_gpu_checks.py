"""Runs tests/gpu/check_sglang.py where it can run: a CUDA GPU and sglang installed.

One case per target: the shrunken Llama, and the shrunken Kimi-K2.5 in its shipping layout
(``KimiK25ForConditionalGeneration`` wrapper, remote-code tiktoken tokenizer, MLA); on a
machine with several GPUs, Kimi-K2.5 also across all of them, tensor parallel and with
data-parallel attention (its 8-GPU layouts).
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


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if _has_cuda_and_sglang() else 0


def _cases() -> list[list[str]]:
    cases = [["--model", "llama"], ["--model", "kimi-wrapper"]]
    gpus = _gpu_count()
    if gpus >= 2:  # heads and experts of the shrunken Kimi (8 each) divide by 2, 4 and 8
        tp = str(min(8, 1 << (gpus.bit_length() - 1)))
        cases += [
            ["--model", "kimi-wrapper", "--tp", tp],
            ["--model", "kimi-wrapper", "--tp", tp, "--dp-attention", tp],
        ]
    return cases


@pytest.mark.skipif(not _has_cuda_and_sglang(), reason="needs a CUDA GPU and sglang")
@pytest.mark.parametrize("args", _cases(), ids=lambda a: "-".join(x.lstrip("-") for x in a))
def test_sglang_capture_matches_transformers_on_gpu(args: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, str(CHECK), *args],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    print(result.stdout, result.stderr[-5000:])
    assert result.returncode == 0, result.stdout
    assert "PASS" in result.stdout
