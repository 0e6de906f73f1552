"""One conversation's regeneration, turn by turn: which requests it makes, the answers it
keeps, and the journal record it becomes (the tool-calling rules are the driver's module
docstring); and a batch of them through an in-process engine (:func:`regenerate`)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from ..turn_ids import compact_token_ids
from .engines import Completion, Engine, TurnFailure
from .job import Prompt
from .records import JournalRecord, Turn, failed_record, ok_record


def batch_seed(seed: int, first_id: str, turn: int) -> int:
    digest = hashlib.sha256(f"{seed}\x00{first_id}\x00{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


class Conversation:
    """One prompt being regenerated: source assistant turns are dropped and, at each
    point where the source had one (after each user turn and after each run of tool
    turns), the engine answers on the regenerated history."""

    def __init__(self, prompt: Prompt) -> None:
        self.prompt = prompt
        self.tools = prompt.tools or None
        self.history: list[dict[str, Any]] = []
        self.segments = segments(prompt.messages)
        self.opened = 0  # segments appended to the history so far
        self.turns: list[Turn] = []
        self.failure: str | None = None
        self.failure_kind: str | None = None
        self.failure_spent = 0  # tokens the failed turn cost (an answer not kept)
        self._ids_so_far: list[int] = []  # the last turn's prompt then completion ids

    def next_request(self) -> list[dict[str, Any]] | None:
        """The history up to the next regeneration point, or None when finished."""
        k = len(self.turns)
        if self.failure is not None or k >= len(self.segments):
            return None
        if self.opened == k:  # idempotent: the batch loop asks twice per round
            segment = self.segments[k]
            if k and self.history and self.history[-1]["role"] == "assistant":
                segment = answering(self.history[-1], segment)
            self.history.extend(segment)
            self.opened += 1
        return self.history

    def add(self, result: Completion | TurnFailure) -> None:
        if isinstance(result, TurnFailure):
            self.failure = f"turn {len(self.turns) + 1}: {result.reason}"
            self.failure_kind, self.failure_spent = result.kind, result.spent_tokens
            return
        message: dict[str, Any] = {"role": "assistant", "content": result.content}
        if result.reasoning_content:
            message["reasoning_content"] = result.reasoning_content
        if result.tool_calls:
            message["tool_calls"] = [dict(call) for call in result.tool_calls]
        self.history.append(message)
        turn: Turn = {
            "finish_reason": result.finish_reason,
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
        }
        if result.usage_source == "tokenizer":
            turn["usage_source"] = "tokenizer"  # the server reported no usage
        if result.prompt_ids is None or result.completion_ids is None:
            turn["token_ids"] = None
            self._ids_so_far = []
        else:
            turn["token_ids"] = compact_token_ids(
                self._ids_so_far, result.prompt_ids, result.completion_ids
            )
            self._ids_so_far = [*result.prompt_ids, *result.completion_ids]
        self.turns.append(turn)

    def record(self) -> JournalRecord:
        p = self.prompt
        if self.failure is not None:
            spent = sum(t["completion_tokens"] for t in self.turns) + self.failure_spent
            return failed_record(p.id, p.prompt_hash, self.failure, spent, self.failure_kind)
        return ok_record(p.id, p.prompt_hash, self.history, self.turns, tools=self.tools)

    def tools_kwargs(self) -> dict[str, Any]:
        """``tools=`` for the engine, only when there are tools: plain conversations
        make exactly the calls they always made."""
        return {} if self.tools is None else {"tools": self.tools}


def answering(assistant: Mapping[str, Any], segment: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``segment`` with its leading tool results linked to the regenerated calls before it.

    A source's tool result names the source's call in ``tool_call_id``, and a regenerated
    turn's calls have ids of their own (SGLang's are random ``call_<hex>`` for most
    parsers, ``functions.<name>:<n>`` for Kimi's). The target should see its results answer
    its own calls: Kimi-K2.5's template renders the call's id and ``## Return of <id>``,
    and servers that check the link refuse a result that answers no call of the turn
    before (OpenAI's API; SGLang 0.5.23 for MiniMax-M3: 400 "tool_call_id ... does not
    match an unanswered tool call"). So where the regenerated turn made as many calls as
    the source has results, result ``j`` takes the id of call ``j``; its content and name
    stay as given. Otherwise (other counts, no calls) the results stay as they are.
    """
    calls = assistant.get("tool_calls") or []
    n = 0
    while n < len(segment) and segment[n]["role"] == "tool":
        n += 1
    if not calls or n != len(calls):
        return segment
    linked = [
        {**result, "tool_call_id": call["id"]} if call.get("id") else result
        for result, call in zip(segment[:n], calls, strict=True)
    ]
    return linked + segment[n:]


def segments(messages: Sequence[Mapping[str, Any]]) -> list[list[dict[str, Any]]]:
    """The source's non-assistant turns, cut at each regeneration point: segment k is
    what is appended to the history before the k-th regenerated assistant turn.

    A point follows every user turn and the last tool turn of each run; a leading
    system turn opens the first segment; source assistant turns are dropped.
    """
    segments: list[list[dict[str, Any]]] = []
    current: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role = message["role"]
        if role == "assistant" or (role == "system" and i > 0):
            continue
        # Unset keys would reach the server and the template as nulls.
        current.append({k: v for k, v in message.items() if v is not None})
        following = messages[i + 1]["role"] if i + 1 < len(messages) else None
        if role == "user" or (role == "tool" and following != "tool"):
            segments.append(current)
            current = []
    return segments


def regenerate(engine: Engine, prompts: Sequence[Prompt], seed: int) -> list[JournalRecord]:
    """Regenerate a batch with an in-process engine, one round per turn index.

    A conversation fails as a whole if one of its turns fails.
    """
    convs = [Conversation(p) for p in prompts]
    turn = 0
    while True:
        active = [c for c in convs if c.next_request() is not None]
        if not active:
            break
        requests = [c.next_request() or [] for c in active]
        tools = [c.tools for c in active]
        kwargs = {"tools": tools} if any(t is not None for t in tools) else {}
        results = engine.complete(requests, seed=batch_seed(seed, prompts[0].id, turn), **kwargs)
        for conv, res in zip(active, results, strict=True):
            conv.add(res)
        turn += 1
    return [c.record() for c in convs]
