"""The capture backends, and the one ``hidden_states.backend`` names.

Every backend is an :class:`Extractor`: ``aux``, ``hidden_size``, ``dtype``,
``final_state`` (which final state ``last`` is: :mod:`.final_state`) and
``forward(samples)`` returning ``(aux [T, 3H], last [T, H])`` CPU tensors per sample, in
the model dtype:

* ``transformers`` (:mod:`.transformers_capture`): in-process forward with hooks, on the
  CPU, one GPU, or several (``device_map="auto"``);
* ``sglang`` (:mod:`.sglang_capture`): SGLang's offline engine, tensor/expert parallel;
* ``vllm`` (:mod:`.vllm_capture`): a vLLM server the user runs, with vLLM's own
  hidden-state extraction (any layout vLLM serves).

Nothing heavy is imported until a backend is built (the job takes its GPUs first).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ..gpu_slots import VISIBLE_ENV, held_gpu_count, parse_visible
from .layers import AuxLayers
from .settings import CaptureSettings

if TYPE_CHECKING:
    import torch

BACKENDS = ("transformers", "sglang", "vllm")


class Extractor(Protocol):
    """What the shard loop needs from a backend."""

    aux: AuxLayers
    hidden_size: int
    dtype: torch.dtype
    final_state: str

    def forward(self, samples: Sequence[Sequence[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(aux, last) per sample; a backend that captures images (transformers) also takes
        ``images=``, each sample's pictures in order."""
        ...

    def capture_fingerprint(self) -> dict[str, Any]:
        """Its part of the shards' fingerprint (:mod:`.fingerprint`): ``engine``,
        ``layout``, ``aux_layers_confirmed_by`` (and ``weights_quantization`` where the
        engine quantizes)."""
        ...


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
    capture: CaptureSettings,
    *,
    sglang_engine_factory: Callable[[Mapping[str, Any]], Any] | None = None,
    job: str = "capture",
) -> Extractor:
    """The backend ``capture`` names; ``job`` names the job's requests to a server."""
    backend = capture.backend
    common: dict[str, Any] = {
        "aux_layers": (
            capture.aux_layers if isinstance(capture.aux_layers, str) else list(capture.aux_layers)
        ),
        "convention": capture.aux_layer_convention,
        "dtype": capture.dtype,
        "trust_remote_code": capture.trust_remote_code,
        "final_state": capture.final_state,
    }
    if backend == "transformers":
        from .transformers_capture import HiddenStateExtractor

        return HiddenStateExtractor(
            model_path, device=capture.device, gpus=job_gpu_count(), **common
        )
    if backend == "sglang":
        from .sglang_capture import SGLangCapture, start_engine

        return SGLangCapture(
            model_path,
            device=capture.device,
            options=capture.sglang,
            batch_tokens=capture.batch_tokens,
            engine_factory=sglang_engine_factory or start_engine,
            **common,
        )
    if backend == "vllm":
        from .vllm_capture import VLLMCapture

        return VLLMCapture(model_path, options=capture.vllm, job=job, **common)
    raise ValueError(f"hidden_states.backend must be one of {list(BACKENDS)}, got {backend!r}")
