"""Engines turn conversations into their next assistant turn; nothing more.

Order, budget, sidecars, resume and progress live in
:mod:`eagle3data.generation`, written once for every engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

Message = dict[str, Any]


@dataclass(frozen=True)
class Completion:
    content: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    reasoning_content: str | None = None
    usage_source: str = "engine"  # "tokenizer" when a server reported no usage


class TransientError(Exception):
    """A request failed in a way worth retrying later (connection, timeout, 5xx):
    the prompt is not recorded and will be dispatched again."""


@dataclass(frozen=True)
class TurnFailure:
    """A permanent failure of one request (recorded; the prompt is skipped)."""

    reason: str


class Engine(Protocol):
    """In-process engines batch internally: many conversations per call."""

    def complete(
        self, conversations: Sequence[Sequence[Message]], *, seed: int
    ) -> list[Completion | TurnFailure]:
        """Next assistant turn for each conversation, in the same order."""
        ...


class AsyncEngine(Protocol):
    """HTTP engines keep many single requests in flight."""

    @property
    def capacity(self) -> int:
        """How many requests it wants in flight at once."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def complete(self, messages: Sequence[Message]) -> Completion | TurnFailure:
        """Next assistant turn; raises TransientError when worth retrying later."""
        ...
