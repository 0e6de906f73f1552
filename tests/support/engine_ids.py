"""Token ids as a server returns them (``return_token_ids``), for tests without a server.

What SGLang 0.5.23 and vLLM 0.32 were seen to return: the prompt ids are the server's
render of the history with the generation prompt, tokenized; the completion ids are what
the model generated, up to and including the end-of-turn token when it stopped (the
template's text after that token, e.g. ChatML's newline, is not generated).

Two things a real target and server do that a re-render cannot reproduce, on demand:

* ``split=True``: the completion is a non-canonical tokenization of its own text (a
  sampled completion can be): every character of its ordinary text is its own token
  sequence, special tokens stay whole. It decodes to the same text.
* ``reasoning_space``: the target began its reasoning with whitespace that the server's
  reasoning parser strips from ``reasoning_content`` (SGLang's and vLLM's do).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from eagle3data.chat import turn_renders


def engine_token_ids(
    tokenizer: Any,
    history: Sequence[Mapping[str, Any]],
    message: Mapping[str, Any],
    *,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    split: bool = False,
    reasoning_space: str = "",
) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) of the assistant ``message`` answering ``history``."""
    wrote = dict(message)
    if reasoning_space and message.get("reasoning_content"):
        wrote["reasoning_content"] = reasoning_space + message["reasoning_content"]
    turn = turn_renders(
        tokenizer, [*history, wrote], chat_template_kwargs=chat_template_kwargs, tools=tools
    )[-1]
    produced = turn.produced
    eos = tokenizer.eos_token
    if eos and eos in produced:  # generation ends on the end-of-turn token
        produced = produced[: produced.index(eos) + len(eos)]
    prompt_ids = _encode(tokenizer, turn.prompt)
    completion_ids = _split_encode(tokenizer, produced) if split else _encode(tokenizer, produced)
    return prompt_ids, completion_ids


def _encode(tokenizer: Any, text: str) -> list[int]:
    if getattr(tokenizer, "is_fast", False):
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer.encode(text))  # Kimi's tiktoken: specials allowed, no BOS


def _split_encode(tokenizer: Any, text: str) -> list[int]:
    specials = sorted(
        {*tokenizer.all_special_tokens, *tokenizer.get_added_vocab()}, key=len, reverse=True
    )
    pattern = "(" + "|".join(re.escape(s) for s in specials) + ")"
    ids: list[int] = []
    for piece in re.split(pattern, text):
        if piece in specials:
            ids += _encode(tokenizer, piece)
        else:
            for char in piece:
                ids += _encode(tokenizer, char)
    return ids
