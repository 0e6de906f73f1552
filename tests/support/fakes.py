"""A deterministic fake generation engine for driver tests (no model, no torch).

The completion of a conversation depends only on its content: the answer to a
history ending in user text ``t`` is ``"answer to t"`` and costs
``tokens_for(t)`` completion tokens. The engine records every call and every
conversation it was asked, can fail chosen prompts, and can "die" (raise) after
a number of calls to simulate a job killed mid-run.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Collection, Sequence
from typing import Any

from eagle3data.generation.driver import Prompt
from eagle3data.generation.engines import Completion, TurnFailure
from eagle3data.prompts.sources import prompt_hash


class EngineKilled(RuntimeError):
    """Raised by the fake to simulate the job dying inside an engine call."""


def tokens_for(text: str) -> int:
    return 5 + len(text) % 17


def answer_for(text: str) -> str:
    return f"answer to {text}"


def conv_key(conversation: Sequence[dict[str, Any]]) -> str:
    return json.dumps(list(conversation), sort_keys=True, ensure_ascii=False)


class FakeEngine:
    def __init__(
        self,
        *,
        fail: Collection[str] = (),
        length: Collection[str] = (),
        reasoning: bool = False,
        raise_after_calls: int | None = None,
        tokens: Callable[[str], int] = tokens_for,
    ) -> None:
        self.fail = set(fail)  # user texts whose turn fails
        self.length = set(length)  # user texts whose turn stops at max_tokens
        self.reasoning = reasoning
        self.raise_after_calls = raise_after_calls
        self.tokens = tokens
        self.calls: list[dict[str, Any]] = []  # {"seed", "conversations"} per answered call
        self.attempted_calls = 0

    # -- the Engine protocol -------------------------------------------------
    def complete(
        self, conversations: Sequence[Sequence[dict[str, Any]]], *, seed: int
    ) -> list[Completion | TurnFailure]:
        self.attempted_calls += 1
        if self.raise_after_calls is not None and len(self.calls) >= self.raise_after_calls:
            raise EngineKilled(f"killed at call {self.attempted_calls}")
        assert isinstance(seed, int)
        snapshot = copy.deepcopy([list(c) for c in conversations])
        self.calls.append({"seed": seed, "conversations": snapshot})
        out: list[Completion | TurnFailure] = []
        for conv in snapshot:
            assert conv, "empty conversation"
            last = conv[-1]
            assert last["role"] == "user", conv
            text = last["content"]
            if text in self.fail:
                out.append(TurnFailure(f"refused {text!r}"))
                continue
            out.append(
                Completion(
                    content=answer_for(text),
                    finish_reason="length" if text in self.length else "stop",
                    prompt_tokens=sum(len(m["content"]) for m in conv),
                    completion_tokens=self.tokens(text),
                    reasoning_content=f"thinking about {text}" if self.reasoning else None,
                )
            )
        return out

    # -- what it was asked ---------------------------------------------------
    @property
    def conversations(self) -> list[list[dict[str, Any]]]:
        return [c for call in self.calls for c in call["conversations"]]

    @property
    def asked_keys(self) -> list[str]:
        """Every conversation asked, as canonical JSON (same history -> same key)."""
        return [conv_key(c) for c in self.conversations]

    @property
    def first_user_texts(self) -> list[str]:
        """The first user text of every conversation asked (identifies the prompt)."""
        return [next(m["content"] for m in c if m["role"] == "user") for c in self.conversations]

    @property
    def completion_tokens(self) -> int:
        total = 0
        for c in self.conversations:
            text = c[-1]["content"]
            if text not in self.fail:
                total += self.tokens(text)
        return total

    def seeds_by_conversation(self) -> dict[str, int]:
        return {conv_key(c): call["seed"] for call in self.calls for c in call["conversations"]}


class FakeFactory:
    """An engine factory that counts how often it is called and keeps its engines."""

    def __init__(self, **engine_kwargs: Any) -> None:
        self.engine_kwargs = engine_kwargs
        self.engines: list[FakeEngine] = []

    def __call__(self) -> FakeEngine:
        engine = FakeEngine(**self.engine_kwargs)
        self.engines.append(engine)
        return engine

    @property
    def calls(self) -> int:
        return len(self.engines)

    @property
    def engine(self) -> FakeEngine:
        assert len(self.engines) == 1, f"factory called {len(self.engines)} times"
        return self.engines[0]


def no_engine() -> FakeEngine:
    raise AssertionError("engine_factory must not be called: nothing is left to generate")


def make_prompt(pid: str, messages: list[dict[str, str]]) -> Prompt:
    return Prompt(pid, prompt_hash(messages), messages)


def single_turn(pid: str, text: str, system: str | None = None) -> Prompt:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": text})
    return make_prompt(pid, messages)
