"""The OpenAI chat-completions wire format as SGLang, vLLM and llama.cpp speak it: the
request body with the servers' extensions, and what an answer carries beside the text
(parsed tool calls, reasoning in each server's field, the token ids the server saw and
produced, the usage an aborted request reports), and the errors that mean something
(a refused ``return_token_ids``, a prompt over the context)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

TOKEN_IDS_FIELD = "return_token_ids"
# How servers say a request does not fit the context: SGLang "longer than the model's
# context length" / "maximum context length", vLLM "maximum context length", llama.cpp
# "the available context size".
_OVER_CONTEXT_MESSAGE = re.compile(r"context (length|size|window)", re.IGNORECASE)


def request_body(
    messages: Sequence[Mapping[str, Any]],
    *,
    model: str,
    sampling: Mapping[str, Any],
    seed: int,
    chat_template_kwargs: Mapping[str, Any],
    extra_body: Mapping[str, Any],
    tools: Sequence[Mapping[str, Any]] | None = None,
    return_token_ids: bool = False,
    image_url: Callable[[str], str] | None = None,
) -> dict[str, Any]:
    """The /chat/completions body: OpenAI fields plus the SGLang/vLLM extensions.
    ``image_url`` gives the URL (a data URI) an image part's sha256 is sent as."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [_wire_message(m, image_url) for m in messages],
        "max_tokens": sampling["max_tokens"],
        "temperature": sampling["temperature"],
        "top_p": sampling["top_p"],
        "seed": seed,
        "stream": False,
    }
    if sampling["top_k"] != -1:
        body["top_k"] = sampling["top_k"]
    if sampling["repetition_penalty"] != 1.0:
        body["repetition_penalty"] = sampling["repetition_penalty"]
    if sampling["stop"]:
        body["stop"] = list(sampling["stop"])
    if chat_template_kwargs:
        body["chat_template_kwargs"] = dict(chat_template_kwargs)
    if tools:  # absent otherwise: plain requests stay exactly as they were
        body["tools"] = list(tools)
    if return_token_ids:  # SGLang and vLLM; see OpenAIEngine for servers that refuse it
        body[TOKEN_IDS_FIELD] = True
    body.update(extra_body)
    return body


# What a history message carries to the server. Servers render history themselves;
# reasoning of earlier turns is sent back as reasoning_content, which templates such as
# Qwen3's and Kimi's read. An assistant turn that only calls tools keeps content "": SGLang
# and vLLM render a null content as "" anyway, and tokenize renders "" (chat.render).
_WIRE_KEYS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name")


def _wire_message(
    message: Mapping[str, Any], image_url: Callable[[str], str] | None = None
) -> dict[str, Any]:
    wire = {k: v for k, v in message.items() if k in _WIRE_KEYS}
    if isinstance(wire.get("content"), list):
        wire["content"] = [_wire_part(part, image_url) for part in wire["content"]]
    return wire


def _wire_part(part: Mapping[str, Any], image_url: Callable[[str], str] | None) -> dict[str, Any]:
    """A content part as OpenAI's chat API takes it: SGLang and vLLM both read an image
    as an ``image_url`` part (a data URI here: the server needs no access to our files)."""
    if part["type"] != "image":
        return dict(part)
    if image_url is None:
        raise ValueError("an image part, but no image table to send it from")
    return {"type": "image_url", "image_url": {"url": image_url(part["image"])}}


def parse_tool_calls(raw: Any) -> list[dict[str, Any]] | None:
    """``message.tool_calls`` of a response in the normalised wire form (``index`` and
    other extras dropped, ``arguments`` a JSON string); None when there are none.

    Raises ValueError on a shape that is not a list of function calls."""
    if not raw:
        return None
    if not isinstance(raw, list):
        raise ValueError(f"tool_calls is {type(raw).__name__}, expected a list")
    calls = []
    for call in raw:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"tool call without a function name: {call!r}")
        arguments = function.get("arguments")
        if arguments is None:
            arguments = "{}"  # a call without arguments
        elif not isinstance(arguments, str):  # a server that sends the object itself
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(
            {
                "id": str(call.get("id") or ""),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return calls


def reasoning_of(message: Mapping[str, Any]) -> str | None:
    """A response message's parsed reasoning: SGLang's ``reasoning_content``, vLLM's
    ``reasoning`` (vLLM 0.32 sends no ``reasoning_content``); None when there is none."""
    for key in ("reasoning_content", "reasoning"):
        value = message.get(key)
        if value:
            if not isinstance(value, str):
                raise ValueError(f"message.{key} is {type(value).__name__}, expected a string")
            return value
    return None


class UnknownTokenIds(ValueError):
    """Token ids in a shape we do not know: the answer is good, its ids are not usable."""


def token_ids_of(
    payload: Mapping[str, Any], choice: Mapping[str, Any]
) -> tuple[list[int], list[int]] | None:
    """The (prompt, completion) token ids a server returned for ``return_token_ids``, or
    None when it returned none (a server that ignores the field).

    SGLang 0.5.23: ``choice.prompt_token_ids`` and ``choice.response_token_ids``; vLLM
    0.32: top-level ``prompt_token_ids`` and ``choice.token_ids`` (tests/data/sglang/,
    tests/data/vllm/). Raises UnknownTokenIds on ids that are not lists of integers, or
    on one of the two without the other."""
    prompt = choice.get("prompt_token_ids", payload.get("prompt_token_ids"))
    completion = choice.get("response_token_ids", choice.get("token_ids"))
    if prompt is None and completion is None:
        return None
    if prompt is None or completion is None:
        missing = "prompt" if prompt is None else "completion"
        raise UnknownTokenIds(f"the response has token ids without the {missing}'s")
    return _int_list("prompt_token_ids", prompt), _int_list("completion token_ids", completion)


def _int_list(name: str, value: Any) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in value
    ):
        raise UnknownTokenIds(f"{name} is not a list of integers")
    return value


# A refusal of the field itself: the field named next to words that refuse an argument.
# Naming it alone is not enough: vLLM's 400 for an unrelated validation error echoes the
# whole request (``'input': {..., 'return_token_ids': True, ...}``).
_REFUSAL = r"(unrecogni[sz]ed|unknown|unexpected|extra|not permitted|not allowed|unsupported)"
_REFUSES_IDS = re.compile(
    rf"{_REFUSAL}[^.]{{0,80}}{TOKEN_IDS_FIELD}|{TOKEN_IDS_FIELD}[^.]{{0,80}}{_REFUSAL}",
    re.IGNORECASE,
)


def refuses_token_ids(body: Mapping[str, Any], status: int, message: str) -> bool:
    """Whether a 4xx answer refused ``return_token_ids`` itself: the request carried it
    and the error refuses it by name (OpenAI's "Unrecognized request argument supplied:
    return_token_ids", a strict server's "extra inputs are not permitted" at the field)."""
    return (
        TOKEN_IDS_FIELD in body and 400 <= status < 500 and _REFUSES_IDS.search(message) is not None
    )


def says_over_context(message: str) -> bool:
    """Whether a server's error says the request does not fit its context."""
    return _OVER_CONTEXT_MESSAGE.search(message) is not None


def aborted_decode(status: int, payload: Any) -> int | None:
    """What an aborted request's answer says it decoded: SGLang answers a request aborted
    by its rid with ``finish_reason: "abort"`` and its usage so far (one that finished first
    answers as usual, its usage all the same). None when the answer says nothing."""
    if status != 200 or not isinstance(payload, dict):
        return None
    usage = payload.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0:
        return tokens
    return None


def server_root(url: str) -> str:
    """``http://host:port`` of an OpenAI base URL (``.../v1``): where SGLang's own routes are."""
    return url.removesuffix("/v1")


def without_token_ids(body: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != TOKEN_IDS_FIELD}
