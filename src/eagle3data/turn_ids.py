"""A turn's token ids as the journal stores them, once: each turn's prompt ids are the
previous turn's prompt and completion ids cut at ``prompt_shared``, then ``prompt`` (a
conversation's history is not repeated in every turn). Written by the generate stage
(:mod:`eagle3data.generation.records`), read back by the tokenize stage and by the capture's
mask check, which therefore need nothing else of the generate stage."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict


class TurnTokenIds(TypedDict):
    """A turn's token ids, stored once: the turn's prompt ids are the previous turn's
    prompt and completion ids cut at ``prompt_shared``, then ``prompt`` (a conversation's
    history is not repeated in every turn)."""

    prompt_shared: int
    prompt: list[int]
    completion: list[int]


def compact_token_ids(
    previous: Sequence[int], prompt_ids: Sequence[int], completion_ids: Sequence[int]
) -> TurnTokenIds:
    """A turn's ids stored against ``previous``, the last turn's prompt then completion
    ids ([] for the first turn); :func:`turn_token_ids` undoes it."""
    shared = 0
    for a, b in zip(previous, prompt_ids, strict=False):
        if a != b:
            break
        shared += 1
    return {
        "prompt_shared": shared,
        "prompt": list(prompt_ids[shared:]),
        "completion": list(completion_ids),
    }


def turn_token_ids(turns: Sequence[Mapping[str, Any]]) -> list[tuple[list[int], list[int]] | None]:
    """Each turn's (prompt ids, completion ids) as the engine returned them; None for a
    turn without ids (the turn after one is stored against nothing)."""
    out: list[tuple[list[int], list[int]] | None] = []
    previous: list[int] = []
    for turn in turns:
        ids = turn.get("token_ids")
        if ids is None:
            out.append(None)
            previous = []
            continue
        shared = int(ids["prompt_shared"])
        if shared > len(previous):
            raise ValueError(
                f"token_ids.prompt_shared {shared} exceeds the previous turn's {len(previous)} ids"
            )
        prompt = previous[:shared] + list(ids["prompt"])
        completion = list(ids["completion"])
        out.append((prompt, completion))
        previous = prompt + completion
    return out
