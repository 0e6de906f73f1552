"""Engines turn conversations into their next assistant turn; nothing more.

Order, budget, journals, resume and progress live in :mod:`..driver`, written once for
every engine. :func:`build_engine` makes the engine ``generation.backend`` names:

* ``transformers`` (:mod:`.transformers_engine`): in-process, batched, CPU or one GPU;
* ``openai`` (:mod:`.openai_engine`): any OpenAI-compatible server, many requests in
  flight (streaming dispatch).

Tool calling: a conversation may come with ``tools`` (OpenAI tool specs); engines pass
them to the chat template (in-process) or the server (HTTP) with every request of that
conversation, and report the tool calls they parsed in :attr:`Completion.tool_calls`.
Tools are never executed here: the driver keeps the source's tool results.

Nothing heavy is imported until an engine is built.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ...errors import EngineUnavailable
from ...images import ImageSource
from ...servers.http import TransientError
from ..settings import GenerationSettings
from .protocol import (
    CURRENT_REQUEST,
    OVER_CONTEXT,
    AsyncEngine,
    Completion,
    Engine,
    Message,
    RequestTrace,
    Tools,
    TurnFailure,
)

__all__ = [
    "BACKENDS",
    "CURRENT_REQUEST",
    "OVER_CONTEXT",
    "AsyncEngine",
    "Completion",
    "Engine",
    "Message",
    "RequestTrace",
    "Tools",
    "TransientError",
    "TurnFailure",
    "build_engine",
    "is_streaming",
]

BACKENDS = ("transformers", "openai")


def is_streaming(backend: str) -> bool:
    """Whether the backend's engine is an :class:`AsyncEngine` (kept full of requests)."""
    return backend == "openai"


def build_engine(
    settings: GenerationSettings,
    *,
    threads: int | None = None,
    label: str = "generation",
    slot_dir: str | os.PathLike[str] | None = None,
    images: ImageSource | None = None,
) -> Engine | AsyncEngine:
    """The engine of ``settings.backend``.

    ``label`` (the dataset) names the engine's own progress lines; ``slot_dir`` (HTTP
    engines) is where the run's endpoint slots are: each endpoint's ``concurrency`` is then
    shared with the run's other generate jobs (:mod:`.endpoint_slots`). ``images``: the
    dataset's image table, for prompts with images (None: text prompts only).
    """
    backend = settings.backend
    if backend == "transformers":
        return _transformers_engine(settings, threads, label, images)
    if backend == "openai":
        return _openai_engine(settings, slot_dir, images)
    raise ValueError(f"generation.backend must be one of {list(BACKENDS)}, got {backend!r}")


def _transformers_engine(
    settings: GenerationSettings, threads: int | None, label: str, images: ImageSource | None
) -> Engine:
    from ...torch_utils import set_threads
    from .transformers_engine import TransformersEngine

    set_threads(threads)
    return TransformersEngine(
        settings.model_path,
        sampling=settings.sampling,
        chat_template_kwargs=settings.chat_template_kwargs,
        dtype=settings.dtype,
        device=settings.device,
        trust_remote_code=settings.trust_remote_code,
        progress_interval_s=settings.progress_interval_s,
        label=label,
        images=images,
    )


def _openai_engine(
    settings: GenerationSettings,
    slot_dir: str | os.PathLike[str] | None = None,
    images: ImageSource | None = None,
) -> AsyncEngine:
    from .openai_engine import HttpSettings, OpenAIEngine

    api_key = None
    if settings.api_key_env:
        api_key = os.environ.get(settings.api_key_env)
        if not api_key:
            raise EngineUnavailable(
                f"generation.api_key_env names {settings.api_key_env!r}, which is not set"
            )
    assert settings.served_model is not None  # generation_settings sets it for HTTP
    http = HttpSettings(
        endpoints=list(settings.endpoints),
        model=settings.served_model,
        concurrency=settings.concurrency,
        api_key=api_key,
        request_timeout_s=settings.request_timeout_s,
        max_retries=settings.max_retries,
        extra_body=settings.extra_body,
        return_token_ids=settings.return_token_ids,
        slot_dir=None if slot_dir is None else os.fspath(slot_dir),
    )
    return OpenAIEngine(
        http,
        sampling=settings.sampling,
        seed=settings.seed,
        chat_template_kwargs=settings.chat_template_kwargs,
        count_tokens=_lazy_token_counter(
            settings.model_path, trust_remote_code=settings.trust_remote_code
        ),
        images=images,
    )


def _lazy_token_counter(model_path: str, *, trust_remote_code: bool) -> Callable[[str], int]:
    """Counts with the model's tokenizer, loaded only if a server omits usage."""
    tokenizer: list[Any] = []

    def count(text: str) -> int:
        if not tokenizer:
            from ...target import load_tokenizer

            tokenizer.append(load_tokenizer(model_path, trust_remote_code=trust_remote_code))
        return len(tokenizer[0](text, add_special_tokens=False)["input_ids"])

    return count
