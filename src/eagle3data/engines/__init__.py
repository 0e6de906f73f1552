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


@dataclass(frozen=True)
class TurnFailure:
    """A permanent failure of one request (recorded; the prompt is skipped)."""

    reason: str


class Engine(Protocol):
    def complete(
        self, conversations: Sequence[Sequence[Message]], *, seed: int
    ) -> list[Completion | TurnFailure]:
        """Next assistant turn for each conversation, in the same order."""
        ...
