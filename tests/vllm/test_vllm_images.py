"""vLLM 0.32's CPU build cannot serve an image-text target here, and says why: its Qwen2-VL
module imports transformers' torchvision image processor, and PyPI's torchvision does not
load beside the CPU torch (docs/how-to/images.md, "What is verified"). When this test fails,
vLLM serves images here: verify the expanded prompt ids and update that page."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.vllm_server import VLLMServer, VLLMServerError
from support.vlm_models import make_qwen2_vl_dir


def test_vllm_cannot_serve_an_image_target_without_torchvision(tmp_path: Path) -> None:
    model = make_qwen2_vl_dir(tmp_path / "qwen2-vl-tiny")
    log = tmp_path / "server.log"
    server = VLLMServer(model, reasoning_parser=None, tool_call_parser=None, log_path=log)
    with pytest.raises(VLLMServerError, match="exited with code"), server:
        pass
    text = log.read_text(errors="replace")
    assert "No module named 'torchvision'" in text
    assert "Qwen2VLForConditionalGeneration" in text
