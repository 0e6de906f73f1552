"""What every engine speaks: the turn it returns (:class:`Completion`), its failures, the
request trace the driver reads, and the two engine protocols. Apart from the package's
``__init__`` (which builds engines and imports their modules) so that the engines'
modules import these without importing the package that imports them."""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

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
