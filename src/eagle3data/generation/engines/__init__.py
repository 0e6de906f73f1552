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
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

from ...errors import EngineUnavailable

BACKENDS = ("transformers", "openai")

Message = dict[str, Any]
# OpenAI tool specs ({"type": "function", "function": {name, description, parameters}}).
Tools = list[dict[str, Any]]


@dataclass(frozen=True)
class Completion:
    content: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    reasoning_content: str | None = None
    usage_source: str = "engine"  # "tokenizer" when a server reported no usage
    # Parsed calls in OpenAI wire format, ``{"id", "type": "function", "function":
    # {"name", "arguments"}}`` with ``arguments`` a JSON string; None when there are none.
    tool_calls: list[dict[str, Any]] | None = None
    # The token ids the target saw and produced for this turn, as the engine reports them
    # (SGLang and vLLM ``return_token_ids``; the in-process engine always): the prompt as
    # the engine rendered and tokenized it, then the completion up to and including the
    # token that ended it. None when the engine reports none.
    prompt_ids: list[int] | None = None
    completion_ids: list[int] | None = None


class TransientError(Exception):
    """A request failed in a way worth retrying later (connection, timeout, 5xx):
    the prompt is not recorded and will be dispatched again."""


# TurnFailure.kind of a prompt that does not fit the target's context: a server's 4xx
# saying so, or an answer the server cut where the context ended (vLLM clamps max_tokens).
OVER_CONTEXT = "over_context"


@dataclass(frozen=True)
class TurnFailure:
    """A permanent failure of one request (recorded; the prompt is skipped)."""

    reason: str
    kind: str | None = None  # OVER_CONTEXT, or None for any other failure
    # Completion tokens the server generated for the failed request (an answer cut by the
    # context and not kept): the run's waste, never its budget.
    spent_tokens: int = 0


@dataclass
class RequestTrace:
    """What an HTTP engine tells the driver about a conversation's current request.

    The driver sets one per conversation in :data:`CURRENT_REQUEST` (a task-local context
    variable, so the engine's ``complete`` keeps its signature); the engine fills it in.
    When the driver cancels the conversation, ``decoded_on_cancel`` is what the server said
    the cancelled request had decoded (SGLang's answer to an abort), or None when no server
    said (the driver then estimates it)."""

    endpoint: str | None = None  # where the current request went
    sent_at: float | None = None  # time.monotonic() when it was sent; None: not sent
    decoded_on_cancel: int | None = None
    # Room the driver took for the conversation's first request, from an engine that shares
    # its endpoints with other jobs (``take_slots``): the engine uses it and sets this None.
    slot: Any = None


CURRENT_REQUEST: ContextVar[RequestTrace | None] = ContextVar("current_request", default=None)


class Engine(Protocol):
    """In-process engines batch internally: many conversations per call."""

    def complete(
        self,
        conversations: Sequence[Sequence[Message]],
        *,
        seed: int,
        tools: Sequence[Tools | None] | None = None,
    ) -> list[Completion | TurnFailure]:
        """Next assistant turn for each conversation, in the same order. ``tools``, one
        entry per conversation, is passed only when some conversation has tools."""
        ...


class AsyncEngine(Protocol):
    """HTTP engines keep many single requests in flight."""

    @property
    def capacity(self) -> int:
        """How many requests it wants in flight at once."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def complete(
        self, messages: Sequence[Message], tools: Tools | None = None
    ) -> Completion | TurnFailure:
        """Next assistant turn; raises TransientError when worth retrying later.
        ``tools`` is passed only for conversations that have tools."""
        ...

    # Optional: ``notes``, a mapping of counters about the servers (e.g. endpoints that
    # fell back to text), which the driver copies into the stats; read with getattr.
    # Optional: ``shares_slots``, True when the endpoints' concurrency is shared with other
    # jobs of the run; the driver then takes room for each new conversation before sending
    # it (``take_slots(n)``, each passed in its RequestTrace.slot) and gives back what a
    # cancelled conversation did not use (``return_slot(slot)``).


def is_streaming(backend: str) -> bool:
    """Whether the backend's engine is an :class:`AsyncEngine` (kept full of requests)."""
    return backend == "openai"


def build_engine(
    settings: Mapping[str, Any],
    execution: Mapping[str, Any],
    *,
    threads: int | None = None,
    label: str = "generation",
    slot_dir: str | os.PathLike[str] | None = None,
) -> Engine | AsyncEngine:
    """The engine of ``settings["backend"]``.

    ``settings`` is what changes the output (:func:`..settings.generation_settings`, the
    rule's params); ``execution`` says how to run (device, endpoints, concurrency, ...);
    ``label`` (the dataset) names the engine's own progress lines; ``slot_dir`` (HTTP
    engines) is where the run's endpoint slots are: each endpoint's ``concurrency`` is then
    shared with the run's other generate jobs (:mod:`.endpoint_slots`).
    """
    backend = settings["backend"]
    if backend == "transformers":
        return _transformers_engine(settings, execution, threads, label)
    if backend == "openai":
        return _openai_engine(settings, execution, slot_dir)
    raise ValueError(f"generation.backend must be one of {list(BACKENDS)}, got {backend!r}")


def _transformers_engine(
    settings: Mapping[str, Any], execution: Mapping[str, Any], threads: int | None, label: str
) -> Engine:
    from ...torch_utils import set_threads
    from .transformers_engine import TransformersEngine

    set_threads(threads)
    return TransformersEngine(
        settings["model_path"],
        sampling=settings["sampling"],
        chat_template_kwargs=settings["chat_template_kwargs"],
        dtype=settings["dtype"],
        device=execution["device"],
        trust_remote_code=execution.get("trust_remote_code", False),
        progress_interval_s=execution.get("progress_interval_s"),
        label=label,
    )


def _openai_engine(
    settings: Mapping[str, Any],
    execution: Mapping[str, Any],
    slot_dir: str | os.PathLike[str] | None = None,
) -> AsyncEngine:
    from .openai_engine import HttpSettings, OpenAIEngine

    api_key = None
    if execution["api_key_env"]:
        api_key = os.environ.get(execution["api_key_env"])
        if not api_key:
            raise EngineUnavailable(
                f"generation.api_key_env names {execution['api_key_env']!r}, which is not set"
            )
    http = HttpSettings(
        endpoints=execution["endpoints"],
        model=settings["served_model"],
        concurrency=execution["concurrency"],
        api_key=api_key,
        request_timeout_s=execution["request_timeout_s"],
        max_retries=execution["max_retries"],
        extra_body=settings["extra_body"],
        return_token_ids=execution.get("return_token_ids", True),
        slot_dir=None if slot_dir is None else os.fspath(slot_dir),
    )
    return OpenAIEngine(
        http,
        sampling=settings["sampling"],
        seed=settings["seed"],
        chat_template_kwargs=settings["chat_template_kwargs"],
        count_tokens=_lazy_token_counter(
            settings["model_path"], trust_remote_code=execution.get("trust_remote_code", False)
        ),
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
