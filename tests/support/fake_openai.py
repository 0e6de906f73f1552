"""A fake OpenAI-compatible chat server for fault-injection tests and benchmarks.

It speaks the two endpoints the HTTP generation backend uses, non-streaming, in the
shapes of one of two real servers, its ``dialect`` (the keys, types and nesting of what the
real server answered, recorded in ``tests/data/sglang/`` and ``tests/data/vllm/``;
``tests/unit/test_fake_openai.py`` holds the fake to both):

* ``POST {base}/chat/completions`` -> a ``chat.completion`` object with ``usage``;
* ``GET {base}/models`` -> ``{"object": "list", "data": [{"id": model, ...}]}``;
* errors in the dialect's body;

plus ``GET /stats`` (counters as JSON) and ``POST /stats/reset`` for benchmarks.
``base`` is ``http://127.0.0.1:PORT/v1``. The server only ever binds 127.0.0.1.

Dialects
    ``dialect="sglang"`` (the default), SGLang 0.5.23: ``usage`` with ``reasoning_tokens``
    and ``completion_tokens_details`` (null without reasoning), each choice with
    ``matched_stop`` and ``logprobs``, a top-level ``metadata``; the message's reasoning in
    ``reasoning_content`` (null without), ``content`` "" when all is reasoning; tool calls
    with an ``index``; errors flat, ``{"object": "error", "message", "type", "param",
    "code"}``; a prompt that fits but not with ``max_tokens`` more is a 400.

    ``dialect="vllm"``, vLLM 0.32: the message's reasoning in ``reasoning`` (there is no
    ``reasoning_content``; null without), ``content`` null when all is reasoning, and
    ``refusal``, ``annotations``, ``audio``, ``function_call`` (null); each choice with
    ``stop_reason`` (null: the fake has no stop strings), ``token_ids``, ``logprobs``,
    ``routed_experts``; top-level ``prompt_token_ids``, ``prompt_text``, ``service_tier``,
    ``system_fingerprint`` and the other keys vLLM sends (null); ``usage`` with
    ``completion_tokens_details: {"reasoning_tokens": n}`` always and no top-level
    ``reasoning_tokens``; tool-call ids ``chatcmpl-tool-<16 hex>`` and no ``index``;
    ``/models`` entries with a ``permission`` list; errors nested, ``{"error": {"message",
    "type", "param", "code"}}`` with vLLM's ``param`` (``input_tokens``, ``max_tokens``,
    ``body.messages``, ``model``) and messages; a prompt that fits but not with
    ``max_tokens`` more gets ``max_tokens`` clamped to what is left (200, ``length``:
    vLLM's ``get_max_tokens``, ``min(max_tokens, max_model_len - prompt)``, recorded in
    ``tests/data/vllm/error_context_with_max_tokens.json``); ``/models`` reports
    ``max_model_len`` (vLLM's ``ModelCard``).

    ``error_style`` overrides the dialect's error bodies: ``"sglang"`` (flat),
    ``"openai"`` (OpenAI's and llama.cpp's nested body, SGLang's ``type`` names) or
    ``"vllm"`` (nested, vLLM's ``type`` names).

Token ids
    ``token_ids_fn(body, message) -> (prompt_ids, completion_ids) | None`` is called for a
    completion whose request asks ``return_token_ids: true``; ``body`` is the request and
    ``message`` the answer in the form the engine keeps it, the same in both dialects
    (``role``, ``content`` a string, ``reasoning_content`` and ``tool_calls``, wire form,
    only when present). The ids it returns go where the dialect puts them: SGLang's
    ``choices[0].prompt_token_ids`` and ``choices[0].response_token_ids``, vLLM's top-level
    ``prompt_token_ids`` and ``choices[0].token_ids``. Without the hook, without the flag,
    or when it returns None, the answer has no ids (SGLang: no keys; vLLM: the keys, null).
    ``usage`` still counts the fake's words: a hook whose ids must agree with it goes with
    a ``tokens_fn`` that says as many.

Deterministic completions
    "Tokens" are whitespace-separated words. A conversation (its ``messages``) is
    answered with ``n`` tokens, ``n = tokens_fn(messages)`` or by default
    ``mean_tokens + spread`` with a spread in ``[-token_spread, +token_spread]``
    taken from a SHA-256 of the messages. The reply repeats the words of
    ``"Answer to: <last user message>"`` until it has ``n`` words. With
    ``reasoning=True`` the first ``min(reasoning_tokens, n)`` tokens go to
    ``reasoning_content`` (words of ``"Thinking about: <last user message>"``) and
    the rest to ``content`` (``""`` when nothing is left, as SGLang sends it; vLLM: null),
    and ``completion_tokens`` counts both, like vLLM and SGLang do; without reasoning,
    ``reasoning_content`` is null (vLLM: ``reasoning``, as the dialects say). ``max_tokens`` (or
    ``max_completion_tokens``) caps ``n``; a capped reply has
    ``finish_reason == "length"``, otherwise ``"stop"``. ``prompt_tokens`` is the
    number of words in all message contents plus one per message. Sampling
    parameters (temperature, seed, ...) are accepted and ignored.

Tool calls
    With ``call_tools=True`` a request that offers ``tools`` (and no ``tool_choice:
    "none"``) and ends with a user message is answered the way SGLang's tool-call parser
    answers: ``content: ""``, ``tool_calls`` with one call (``id`` ``call_<hex>``,
    ``index``, ``type``, ``function`` with ``arguments`` a JSON string) of the named or
    first tool, ``finish_reason: "tool_calls"``; a call cut by ``max_tokens`` is dropped
    (``finish_reason: "length"``, no calls). With ``check_tool_pairing=True`` a history
    whose tool results do not pair with the calls before them is refused (400) with the
    messages SGLang 0.5.23 checks it with for MiniMax-M3 (the only model it checks it for;
    OpenAI's API checks it always): every call of an assistant turn answered by exactly
    one following tool message with its id.

Refused fields
    ``refuse_fields`` names request fields the server refuses: a request that carries one
    gets OpenAI's API answer to a field it does not know, a 400 "Unrecognized request
    argument supplied: <field>" (``invalid_request_error``), in the dialect's error body.
    SGLang 0.5.23 and vLLM 0.32 take ``return_token_ids`` (vLLM ignores fields it does not
    know, with a debug log); this is the server that does not.

Fault injection
    ``faults(body, attempt) -> Fault | None`` is called for every well-formed chat
    request; ``attempt`` is how many times this same ``messages`` list has been
    received (1 the first time). A returned fault replaces the normal answer:
    :class:`Status` (an HTTP error with an OpenAI-style body), :class:`Delay`
    (sleep, then answer or apply another fault), :class:`Drop` (close the
    connection without a response, or mid-body), :class:`MalformedJSON`
    (200 with a body that is not JSON) and :class:`NoUsage` (a valid completion
    without ``usage``). :class:`FaultPlan` scripts faults per conversation and
    attempt; :func:`hashed_faults` faults a deterministic fraction of conversations.

Engine capacity
    With ``slots=S`` at most S requests are "generating" at once; others wait in
    a FIFO queue. A request holds its slot for ``base_latency_s`` (its prefill, no token
    decoded) and then decodes at ``tokens_per_s`` (all at once without it): it leaves after
    ``base_latency_s + completion_tokens / tokens_per_s`` seconds. If the client closes the
    connection (timeout, cancellation) the handler is cancelled and the request counts as
    ``cancelled``; the engine notices it:

    * at once (``disconnect_check_s=0``, the default): the request leaves the queue or
      its slot there, as vLLM 0.32 does (``tests/vllm/test_vllm_abort.py``);
    * with ``disconnect_check_s=T`` at its next check, as SGLang 0.5.23 does (its
      ``SGLANG_REQUEST_STATE_WAIT_TIMEOUT``, 4 s by default; ``tests/sglang/test_abort.py``):
      at the first multiple of T since the request arrived it leaves; until then it keeps
      its place in the queue (it may get a slot) or its slot, and decodes on.

    What the engine decoded is counted (``stats``, ``GET /stats``): ``decoded_tokens``
    (everything, counted when a request leaves its slot: a finished request its ``n``),
    ``cancelled_decoded_tokens`` (of that, what requests whose client went away or that
    were aborted had decoded when they left: decode time x ``tokens_per_s``, at most n;
    all n when it finished before the engine noticed its client was gone),
    ``cancelled_before_decode`` (such requests that left before their first token: in the
    queue or in the prefill) and ``aborted`` (requests aborted by their rid).

SGLang's abort by request id (``dialect="sglang"``)
    A chat body may carry ``rid`` (SGLang's request id; the reply's ``id`` is then the
    rid, as SGLang's). ``POST /abort_request {"rid": ...}`` (``{"abort_all": true}``: all)
    answers 200 with an empty body, for an unknown rid too, and aborts that request at
    once, queued, decoding or lingering after its client left. Its own reply is SGLang's
    (``tests/data/sglang/queue/``): 200, ``finish_reason: "abort"``, ``matched_stop: null``,
    what it had decoded (``usage.completion_tokens``, the words so far); aborted in the
    queue, ``content: ""`` and ``usage`` all 0, ``prompt_tokens`` included.

Queue gauges
    ``GET /metrics`` (Prometheus text, both dialects, with the real names and labels of
    ``tests/data/sglang/metrics.txt`` and ``tests/data/vllm/metrics.txt``): requests in a
    slot, requests queued, tokens generated (vLLM's counter moves while a request decodes,
    SGLang's when it leaves). ``GET /v1/loads`` (SGLang's, ``dialect="sglang"``): the same
    gauges in SGLang's JSON (``tests/data/sglang/queue/loads.json``).

Running it
    In-process (pytest)::

        with FakeOpenAIServer(faults=FaultPlan({"hi": [Status(503)]})) as server:
            post(server.url + "/chat/completions", ...)
            server.requests, server.stats, server.attempts(messages)

    As a separate process (benchmarks)::

        python tests/support/fake_openai.py --port 0 --slots 64 --tokens-per-s 200 \\
            --mean-tokens 200
        # prints "READY http://127.0.0.1:PORT/v1", exits on SIGTERM/SIGINT

    Run ``python tests/support/fake_openai.py --help`` for all flags.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import hashlib
import itertools
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from aiohttp import web

HOST = "127.0.0.1"
DEFAULT_MODEL = "fake-model"
EOS_TOKEN_ID = 2  # ``matched_stop`` of a reply that ended on its own (an int, as SGLang's)
UNBOUNDED_CONTEXT = 1 << 20  # ``max_model_len`` reported without a ``max_model_len``

# ---------------------------------------------------------------------------
# Faults
# ---------------------------------------------------------------------------


def _default_error_type(code: int, style: str = "sglang") -> str:
    """SGLang's: ``BadRequestError`` for its own 400s, the status as a string for the
    rest (its HTTPException handler). vLLM's: ``BadRequestError``, ``NotFoundError``,
    ``InternalServerError``, else the status's phrase (its ``create_error_response``)."""
    if code == 400:
        return "BadRequestError"
    if style != "vllm":
        return str(code)
    named = {404: "NotFoundError", 500: "InternalServerError"}
    return named.get(code) or HTTPStatus(code).phrase


@dataclass(frozen=True)
class Status:
    """Answer with HTTP ``code`` and an error body: SGLang's ``{"object": "error",
    "message", "type", "param", "code"}`` (or, with the server's ``error_style="openai"``,
    ``{"error": {"message", "type", "param", "code"}}``).

    ``type`` defaults from the status as SGLang sends it (``BadRequestError`` for 400,
    else the status as a string; vLLM's names with ``error_style="vllm"``), ``error_code``
    defaults to the status number, ``param`` (vLLM's) to null.
    ``retry_after`` adds a ``Retry-After`` header (seconds). ``raw_body`` replaces the
    JSON body verbatim (e.g. an HTML page from a proxy).
    """

    code: int = 500
    message: str = "Internal server error"
    type: str | None = None
    error_code: str | int | None = None
    retry_after: float | None = None
    raw_body: str | None = None
    param: str | None = None

    @classmethod
    def server_error(cls) -> Status:
        return cls(500, "Internal server error")

    @classmethod
    def overloaded(cls, retry_after: float | None = None) -> Status:
        # What SGLang 0.5.23 answers when decode memory runs out (scheduler retraction).
        return cls(
            503,
            "Retracted under decode memory pressure without a KV backup. Retry later.",
            retry_after=retry_after,
        )

    @classmethod
    def rate_limited(cls, retry_after: float | None = 1.0) -> Status:
        return cls(
            429,
            "Rate limit reached, please retry later",
            error_code="rate_limit_exceeded",
            retry_after=retry_after,
        )

    @classmethod
    def request_timeout(cls) -> Status:
        return cls(408, "Request timed out")

    @classmethod
    def context_length_exceeded(
        cls,
        limit: int = 4096,
        requested: int = 5000,
        max_tokens: int | None = None,
        *,
        dialect: str = "sglang",
    ) -> Status:
        """SGLang's 400 for a prompt longer than the context (``max_tokens`` None) or one
        that fits but not with ``max_tokens`` more; vLLM's for the first (it has none for
        the second: it clamps ``max_tokens``), which counts a prompt only up to one token
        past the limit ("at least")."""
        if dialect == "vllm":
            if max_tokens is not None:
                raise ValueError("vLLM clamps max_tokens to the context: no such error")
            seen = min(requested, limit + 1)
            message = (
                f"This model's maximum context length is {limit} tokens. However, your "
                f"prompt contains at least {seen} input tokens, which exceeds this limit "
                "even without any output tokens. Please reduce the length of the input "
                f"prompt. (parameter=input_tokens, value={seen})"
            )
            return cls(400, message, param="input_tokens")
        if max_tokens is None:
            message = (
                f"The input ({requested} tokens) is longer than the model's context "
                f"length ({limit} tokens)."
            )
        else:
            message = (
                "Requested token count exceeds the model's maximum context length of "
                f"{limit} tokens. You requested a total of {requested} tokens: "
                f"{requested - max_tokens} tokens from the input messages and {max_tokens} "
                "tokens for the completion. Please reduce the number of tokens in the input "
                "messages or the completion to fit within the limit."
            )
        return cls(400, message)

    def error_body(self, style: str = "sglang") -> dict[str, Any]:
        return _error_body(
            self.message,
            self.type or _default_error_type(self.code, style),
            self.error_code if self.error_code is not None else self.code,
            style,
            self.param,
        )


@dataclass(frozen=True)
class Delay:
    """Sleep ``seconds`` before answering (normally, or with the fault ``then``).

    The sleep happens before the request queues for a slot. A client that gives up
    during the sleep closes the connection and the request counts as cancelled.
    """

    seconds: float
    then: Fault | None = None


@dataclass(frozen=True)
class Drop:
    """Close the connection without answering; the client gets a connection error.

    With ``partial=True`` the server first sends a 200 status line, headers that
    promise a longer body and a prefix of it, then closes: the client gets a
    payload error (aiohttp ``ClientPayloadError``, http.client ``IncompleteRead``).
    """

    partial: bool = False


@dataclass(frozen=True)
class MalformedJSON:
    """Answer 200 with ``content_type`` but a ``body`` that is not valid JSON."""

    body: str = '{"id": "chatcmpl-broken", "object": "chat.completion", "choices": [{"ind'
    content_type: str = "application/json"


@dataclass(frozen=True)
class NoUsage:
    """Answer a valid completion (after normal generation time) without ``usage``."""


Fault = Status | Delay | Drop | MalformedJSON | NoUsage
FaultFn = Callable[[dict[str, Any], int], Fault | None]
Matcher = str | Callable[[dict[str, Any]], bool]


class FaultPlan:
    """Faults per conversation and attempt, usable as the server's ``faults``.

    ``plan`` maps a matcher to the faults of successive attempts: the i-th entry
    (``None`` = answer normally) applies to attempt i + 1; attempts beyond the list
    succeed. A matcher is a string (equal to the last user message's text) or a
    predicate on the request body. The first matching entry wins; ``default``
    applies to conversations that match nothing.

        FaultPlan({"q1": [Status(503), Drop()], "q2": [NoUsage()]},
                  default=[Delay(0.1)])
    """

    def __init__(
        self,
        plan: Mapping[Matcher, Sequence[Fault | None]] | None = None,
        *,
        default: Sequence[Fault | None] = (),
    ) -> None:
        self._entries: list[tuple[Matcher, list[Fault | None]]] = []
        self.default = list(default)
        for matcher, faults in (plan or {}).items():
            self.add(matcher, *faults)

    def add(self, matcher: Matcher, *faults: Fault | None) -> FaultPlan:
        """Append an entry (after the existing ones); returns self for chaining."""
        self._entries.append((matcher, list(faults)))
        return self

    def faults_for(self, body: dict[str, Any]) -> list[Fault | None]:
        text = last_user_text(body.get("messages") or [])
        for matcher, faults in self._entries:
            if (matcher == text) if isinstance(matcher, str) else matcher(body):
                return faults
        return self.default

    def __call__(self, body: dict[str, Any], attempt: int) -> Fault | None:
        faults = self.faults_for(body)
        return faults[attempt - 1] if attempt <= len(faults) else None


def hashed_faults(rate: float, fault: Fault, attempts: int = 1) -> FaultFn:
    """Apply ``fault`` to the first ``attempts`` attempts of a fraction ``rate`` of
    conversations, chosen by a hash of the messages (the same ones on every run)."""

    def faults(body: dict[str, Any], attempt: int) -> Fault | None:
        if attempt > attempts:
            return None
        fraction = _hash_int(body.get("messages") or [], "fault") / 2**64
        return fault if fraction < rate else None

    return faults


# ---------------------------------------------------------------------------
# Deterministic completions
# ---------------------------------------------------------------------------


def conversation_key(messages: Sequence[Any]) -> str:
    """Canonical text of a messages list (what attempts are counted by)."""
    return json.dumps(list(messages), sort_keys=True, ensure_ascii=False)


def _hash_int(messages: Sequence[Any], salt: str) -> int:
    digest = hashlib.sha256((salt + "\0" + conversation_key(messages)).encode()).digest()
    return int.from_bytes(digest[:8], "big")


def content_text(content: Any) -> str:
    """Text of a message content: a string or a list of ``{"type": "text"}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content)


def last_user_text(messages: Sequence[Any]) -> str:
    """Text of the last ``user`` message (of the last message if there is none)."""
    dicts = [m for m in messages if isinstance(m, dict)]
    for message in reversed(dicts):
        if message.get("role") == "user":
            return content_text(message.get("content"))
    return content_text(dicts[-1].get("content")) if dicts else ""


def prompt_tokens_of(messages: Sequence[Any]) -> int:
    return sum(
        len(content_text(m.get("content")).split()) + 1 for m in messages if isinstance(m, dict)
    )


def _words(prefix: str, text: str, n: int) -> str:
    base = (prefix + text).split()
    return " ".join(base[i % len(base)] for i in range(n))


def answer_for(text: str, n: int) -> str:
    """The ``n``-word answer to a conversation whose last user text is ``text``."""
    return _words("Answer to: ", text, n)


def reasoning_for(text: str, n: int) -> str:
    return _words("Thinking about: ", text, n)


def _tool_call(
    function: Mapping[str, Any], text: str, messages: Sequence[Any], dialect: str = "sglang"
) -> dict[str, Any]:
    """A call of ``function`` as the dialect's parsers return it: each required parameter
    gets the last user text; the id is the server's form (its hex is random there, hashed
    here): SGLang's ``call_<24 hex>`` with an ``index``, vLLM's ``chatcmpl-tool-<16 hex>``."""
    parameters = function.get("parameters") or {}
    required = parameters.get("required") if isinstance(parameters, dict) else None
    arguments = {str(key): text for key in required or []}
    hexes = f"{_hash_int(messages, 'call'):016x}{_hash_int(messages, 'id'):016x}"
    call: dict[str, Any] = {"id": f"call_{hexes[:24]}", "index": 0}
    if dialect == "vllm":
        call = {"id": f"chatcmpl-tool-{hexes[:16]}"}
    call["type"] = "function"
    call["function"] = {"name": function.get("name"), "arguments": json.dumps(arguments)}
    return call


def tool_pairing_error(messages: Sequence[Any]) -> str | None:
    """Why SGLang 0.5.23 refuses this history for MiniMax-M3, or None: every call of an
    assistant turn must be answered by exactly one following tool message with its
    ``tool_call_id`` (``_tool_call_pairing_error`` in ``entrypoints/openai/serving_chat.py``,
    called only from ``_validate_minimax_m3_request``; same messages)."""
    pending: set[str] | None = None
    unpaired_ids = False
    for message in messages:
        if not isinstance(message, dict):
            continue
        if message.get("role") == "tool":
            if unpaired_ids:
                continue
            if pending is None:
                return "A tool message must follow an assistant message with tool_calls."
            if message.get("tool_call_id") not in pending:
                return (
                    f"tool_call_id {message.get('tool_call_id')!r} does not match an "
                    "unanswered tool call."
                )
            pending.discard(message["tool_call_id"])
            continue
        if pending:
            return f"Tool calls {sorted(pending)} have no tool message answering them."
        pending, unpaired_ids = None, False
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and calls:
            ids = [c.get("id") if isinstance(c, dict) else None for c in calls]
            unpaired_ids = None in ids
            pending = None if unpaired_ids else set(ids)
    last = messages[-1] if messages else None
    if pending and isinstance(last, dict) and last.get("role") == "tool":
        return f"Tool calls {sorted(pending)} have no tool message answering them."
    return None


# ---------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------


DIALECTS = ("sglang", "vllm")
ERROR_STYLES = ("sglang", "openai", "vllm")
TokenIdsFn = Callable[[dict[str, Any], dict[str, Any]], tuple[list[int], list[int]] | None]


def _error_body(
    message: str,
    type_: str,
    code: str | int | None,
    style: str = "sglang",
    param: str | None = None,
) -> dict[str, Any]:
    """The error body of ``style``; ``param`` is vLLM's (the other styles send null)."""
    if style == "vllm":
        return {"error": {"message": message, "type": type_, "param": param, "code": code}}
    if style == "openai":
        return {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return {"object": "error", "message": message, "type": type_, "param": None, "code": code}


_STAT_KEYS = (
    "received",  # chat requests received (any outcome)
    "completed",  # valid completions sent (NoUsage included)
    "cancelled",  # handler cancelled because the client closed the connection
    "dropped",  # connections closed by a Drop fault
    "faulted",  # requests that got an injected fault (Delay counted once)
    "errors",  # error statuses sent: injected Status faults and real 4xx
    "completion_tokens",  # completion tokens of completed requests
    "prompt_tokens",  # prompt tokens of completed requests
    "in_service",  # requests holding a slot now
    "queued",  # requests waiting for a slot now
    "max_in_service",
    "max_queued",
    # What the engine decoded (tokens_per_s), counted when a request leaves its slot:
    # everything, finished or not; the part decoded for requests whose client went away
    # or that were aborted (module doc); and how many of those left before their first
    # token (in the queue or the prefill).
    "decoded_tokens",
    "cancelled_decoded_tokens",
    "cancelled_before_decode",
    "aborted",  # requests aborted by POST /abort_request (SGLang)
)


class FakeOpenAI:
    """The fake server's state and aiohttp app; runs on the caller's event loop.

    Use :meth:`start` / :meth:`stop` inside a running loop, or the threaded
    :class:`FakeOpenAIServer`, or the command line (``main``).

    Options:
        model: the model id served (``/models``); requests may name any model
            unless ``strict_model`` (then a 404 ``model_not_found``).
        api_key: if set, requests must send ``Authorization: Bearer <api_key>``
            (otherwise 401 ``{"error": "Unauthorized"}``, SGLang's body); ``/stats``
            is never protected.
        mean_tokens, token_spread: default completion length ``mean ± spread``
            (spread defaults to ``mean_tokens // 4``), before ``max_tokens``.
        tokens_fn: ``messages -> int`` overriding the default completion length.
        reasoning, reasoning_tokens: add ``reasoning_content`` (see module doc).
        faults: ``(body, attempt) -> Fault | None``; may be reassigned at any time.
        slots: concurrent requests in service (None: unlimited).
        tokens_per_s: generation speed per slot (None or 0: instant).
        base_latency_s: extra time a request holds its slot (prefill).
        max_model_len: if set, ``prompt_tokens + max_tokens`` above it is a 400
            (SGLang's context-length errors); ``max_tokens`` defaults to what is left.
            ``/models`` reports it (else :data:`UNBOUNDED_CONTEXT`).
        call_tools: answer requests that offer tools with a tool call (module doc).
        check_tool_pairing: refuse (400) a history whose tool results do not answer
            the calls before them (SGLang for MiniMax-M3; off: SGLang for other models).
        dialect: ``"sglang"`` or ``"vllm"``: whose shapes the answers have (module doc).
        error_style: None (the dialect's), ``"sglang"`` (flat error bodies), ``"openai"``
            or ``"vllm"`` (nested).
        token_ids_fn: ``(body, message) -> (prompt_ids, completion_ids) | None``, the ids
            of a ``return_token_ids`` answer (module doc); None: answers carry no ids.
        refuse_fields: request fields answered with OpenAI's 400 for an unknown argument
            (module doc).
        disconnect_check_s: how late a closed connection is noticed (0: at once, as vLLM
            does). SGLang checks a non-streaming request's connection only every
            ``SGLANG_REQUEST_STATE_WAIT_TIMEOUT`` (4 s): until the next check since the
            request arrived it keeps its place, queued or decoding, and its slot, and
            what it decodes meanwhile counts in ``cancelled_decoded_tokens``.
    """

    def __init__(
        self,
        *,
        model: str = DEFAULT_MODEL,
        api_key: str | None = None,
        mean_tokens: int = 40,
        token_spread: int | None = None,
        tokens_fn: Callable[[list[dict[str, Any]]], int] | None = None,
        reasoning: bool = False,
        reasoning_tokens: int = 8,
        faults: FaultFn | None = None,
        slots: int | None = None,
        tokens_per_s: float | None = None,
        base_latency_s: float = 0.0,
        max_model_len: int | None = None,
        strict_model: bool = False,
        call_tools: bool = False,
        check_tool_pairing: bool = False,
        dialect: str = "sglang",
        error_style: str | None = None,
        token_ids_fn: TokenIdsFn | None = None,
        refuse_fields: Collection[str] = (),
        disconnect_check_s: float = 0.0,
    ) -> None:
        if slots is not None and slots < 1:
            raise ValueError("slots must be >= 1 or None")
        if dialect not in DIALECTS:
            raise ValueError(f"dialect must be one of {DIALECTS}")
        error_style = dialect if error_style is None else error_style
        if error_style not in ERROR_STYLES:
            raise ValueError(f"error_style must be one of {ERROR_STYLES}")
        self.model = model
        self.api_key = api_key
        self.mean_tokens = mean_tokens
        self.token_spread = mean_tokens // 4 if token_spread is None else token_spread
        self.tokens_fn = tokens_fn
        self.reasoning = reasoning
        self.reasoning_tokens = reasoning_tokens
        self.faults = faults
        self.slots = slots
        self.tokens_per_s = tokens_per_s
        self.base_latency_s = base_latency_s
        self.max_model_len = max_model_len
        self.strict_model = strict_model
        self.call_tools = call_tools
        self.check_tool_pairing = check_tool_pairing
        self.dialect = dialect
        self.error_style = error_style
        self.token_ids_fn = token_ids_fn
        self.refuse_fields = tuple(refuse_fields)
        self.disconnect_check_s = disconnect_check_s

        self._lock = threading.Lock()
        self._by_rid: dict[str, _Work] = {}  # for POST /abort_request
        self._engine_tasks: set[asyncio.Task[tuple[int, bool]]] = set()
        self._in_service: set[_Work] = set()  # requests holding a slot
        self._works: set[_Work] = set()  # requests queued or in a slot (or lingering)
        self._requests: list[dict[str, Any]] = []
        self._attempts: dict[str, int] = {}
        self._completed: collections.Counter[str] = collections.Counter()
        self._stats: dict[str, int] = dict.fromkeys(_STAT_KEYS, 0)
        self._ids = itertools.count(1)
        self._dropping: set[int] = set()  # ids of requests being dropped on purpose
        self._semaphore: asyncio.Semaphore | None = None
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    # -- public state (thread-safe) ---------------------------------------

    @property
    def url(self) -> str:
        """The OpenAI base URL, ``http://127.0.0.1:PORT/v1``."""
        if self.port is None:
            raise RuntimeError("server not started")
        return f"http://{HOST}:{self.port}/v1"

    @property
    def requests(self) -> list[dict[str, Any]]:
        """Copies of the JSON bodies of all chat requests received, in order."""
        with self._lock:
            return list(self._requests)

    @property
    def stats(self) -> dict[str, int]:
        """A snapshot of the counters (see ``_STAT_KEYS``)."""
        with self._lock:
            return dict(self._stats)

    def attempts(self, messages: Sequence[Any]) -> int:
        """How many chat requests with exactly these messages were received."""
        with self._lock:
            return self._attempts.get(conversation_key(messages), 0)

    def completed_per_conversation(self) -> dict[str, int]:
        """How many valid completions were sent for each distinct messages list."""
        with self._lock:
            return dict(self._completed)

    def reset(self) -> None:
        """Forget requests, attempts and counters (current gauges are kept)."""
        with self._lock:
            self._requests.clear()
            self._attempts.clear()
            self._completed.clear()
            for key in _STAT_KEYS:
                if key not in ("in_service", "queued"):
                    self._stats[key] = 0
            self._stats["max_in_service"] = self._stats["in_service"]
            self._stats["max_queued"] = self._stats["queued"]

    def completion_tokens_for(self, messages: list[dict[str, Any]]) -> int:
        """Tokens the fake generates for ``messages`` before any ``max_tokens`` cap."""
        if self.tokens_fn is not None:
            return max(0, int(self.tokens_fn(messages)))
        spread = self.token_spread
        offset = _hash_int(messages, "tokens") % (2 * spread + 1) - spread if spread > 0 else 0
        return max(1, self.mean_tokens + offset)

    # -- running -----------------------------------------------------------

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        if self.dialect == "sglang":
            app.router.add_post("/abort_request", self._abort_request)
            app.router.add_get("/v1/loads", self._loads)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/stats", self._get_stats)
        app.router.add_post("/stats/reset", self._reset_stats)
        return app

    async def start(self, port: int = 0, backlog: int = 4096) -> str:
        """Listen on 127.0.0.1:``port`` (0: any free port); returns :attr:`url`."""
        self._semaphore = asyncio.Semaphore(self.slots) if self.slots else None
        runner = web.AppRunner(
            self.make_app(),
            handler_cancellation=True,  # client disconnect cancels the handler
            access_log=None,
            shutdown_timeout=0.5,
        )
        await runner.setup()
        try:
            site = web.TCPSite(runner, HOST, port, backlog=backlog, reuse_address=True)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = runner.addresses[0][1]
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    # -- bookkeeping ---------------------------------------------------------

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n

    def _gauge(self, key: str, delta: int) -> None:
        with self._lock:
            value = self._stats[key] + delta
            self._stats[key] = value
            if value > self._stats["max_" + key]:
                self._stats["max_" + key] = value

    # -- handlers ---------------------------------------------------------

    def _unauthorized(self, request: web.Request) -> web.Response | None:
        if self.api_key is None:
            return None
        if request.headers.get("Authorization", "") == f"Bearer {self.api_key}":
            return None
        return web.json_response({"error": "Unauthorized"}, status=401)  # SGLang's body

    async def _models(self, request: web.Request) -> web.Response:
        denied = self._unauthorized(request)
        if denied is not None:
            return denied
        model = {
            "id": self.model,
            "object": "model",
            "created": 0,
            "owned_by": self.dialect,  # SGLang says "sglang", vLLM "vllm"
            "root": self.model,
            "parent": None,
            "max_model_len": self.max_model_len or UNBOUNDED_CONTEXT,
        }
        if self.dialect == "vllm":
            model["permission"] = [
                {
                    "id": "modelperm-fake",
                    "object": "model_permission",
                    "created": 0,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ]
        return web.json_response({"object": "list", "data": [model]})

    async def _json_object(self, request: web.Request) -> dict[str, Any] | web.Response:
        """The request's JSON object body, or what the server answers instead: 401 without
        the API key, 400 for a body that is not a JSON object."""
        denied = self._unauthorized(request)
        if denied is not None:
            return denied
        try:
            body = await request.json()
        except ValueError as exc:
            return self._error(400, f"Invalid JSON body: {exc}", "Bad Request", 400)
        if not isinstance(body, dict):
            return self._error(400, "The body must be a JSON object", "Bad Request", 400)
        return body

    async def _abort_request(self, request: web.Request) -> web.Response:
        """SGLang's ``POST /abort_request {"rid"}``: the request leaves the queue, or stops
        decoding, at once, and answers (``finish_reason: "abort"``, its usage so far).
        An unknown rid is ignored; the answer is an empty 200 either way, as SGLang's."""
        body = await self._json_object(request)
        if isinstance(body, web.Response):
            return body
        if body.get("abort_all") is True:
            works = list(self._works)
        else:
            work = self._by_rid.get(str(body.get("rid") or ""))
            works = [work] if work is not None else []
        for work in works:
            work.aborted = True
            work.stop.set()
        return web.Response(status=200)

    async def _loads(self, request: web.Request) -> web.Response:
        """SGLang's ``GET /v1/loads`` (``include=core``), in the shape SGLang 0.5.23 sent
        (``tests/data/sglang/queue/loads.json``): one data-parallel rank whose
        ``num_running_reqs`` and ``num_waiting_reqs`` are the fake's slots in use and its
        queue; the other figures are 0. The ``queues`` section SGLang adds for
        ``include=queues`` is left out (as by a server before it): the fake retracts
        nothing."""
        stats = self.stats
        now = time.time()
        load: dict[str, Any] = {
            "timestamp": now,
            "dp_rank": 0,
            "num_running_reqs": stats["in_service"],
            "num_waiting_reqs": stats["queued"],
        }
        for key in (
            "num_waiting_uncached_tokens",
            "num_used_tokens",
            "num_total_tokens",
            "num_active_tokens",
            "num_prealloc_ready_tokens",
            "max_total_num_tokens",
        ):
            load[key] = 0
        load["max_running_requests"] = self.slots or 0
        for key in ("token_usage", "gen_throughput", "cache_hit_rate", "utilization"):
            load[key] = 0.0
        load["total_prefill_uncached_tokens"] = load["total_prefill_busy_us"] = 0
        load["decode_moments"] = [0.0] * 6
        return web.json_response(
            {
                "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(now)),
                "version": "0.5.23",
                "accelerator": None,
                "num_accelerators": 1,
                "loads": [load],
            }
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        """``GET /metrics`` in Prometheus text: the dialect's gauges of running and waiting
        requests and its counter of generated tokens, with its names, help and labels
        (``tests/data/sglang/metrics.txt``, ``tests/data/vllm/metrics.txt``). SGLang counts
        a request's tokens when it leaves, finished or aborted (``decoded_tokens``); vLLM
        at every step, so its counter includes what the requests in service decoded so far.
        Unlike SGLang's (updated when its scheduler logs, every 40 decode steps), the
        fake's gauges are always current. Real SGLang serves this only with
        ``--enable-metrics``."""
        stats = self.stats
        running, waiting = float(stats["in_service"]), float(stats["queued"])
        if self.dialect == "vllm":
            labels = f'{{engine="0",model_name="{self.model}"}}'
            series = [
                ("vllm:num_requests_running", "gauge", "Number of requests in model "
                 "execution batches.", labels, running),
                ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be "
                 "processed.", labels, waiting),
                ("vllm:generation_tokens_total", "counter", "Number of generation tokens "
                 "processed.", labels, float(self._live_decoded_tokens())),
            ]  # fmt: skip
        else:
            gauge = (
                f'{{engine_type="unified",model_name="{self.model}",moe_ep_rank="0",'
                'pp_rank="0",tp_rank="0"}'
            )
            counter = f'{{engine_type="unified",is_streaming="false",model_name="{self.model}"}}'
            series = [
                ("sglang:num_running_reqs", "gauge", "The number of running requests.",
                 gauge, running),
                ("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting "
                 "queue.", gauge, waiting),
                ("sglang:generation_tokens_total", "counter", "Number of generation tokens "
                 "processed.", counter, float(stats["decoded_tokens"])),
            ]  # fmt: skip
        lines = []
        for name, kind, help_text, labels, value in series:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            lines.append(f"{name}{labels} {value}")
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _get_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats)

    async def _reset_stats(self, request: web.Request) -> web.Response:
        self.reset()
        return web.json_response(self.stats)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self._count("received")
        try:
            response = await self._chat_inner(request)
        except asyncio.CancelledError:
            # Drop closes the transport, which makes aiohttp cancel the handler too.
            if id(request) not in self._dropping:
                self._count("cancelled")
            raise
        finally:
            self._dropping.discard(id(request))
        if response.status >= 400:
            self._count("errors")
        return response

    async def _chat_inner(self, request: web.Request) -> web.StreamResponse:
        body = await self._json_object(request)
        if isinstance(body, web.Response):
            return body
        with self._lock:
            self._requests.append(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            problem = "'messages' must be a non-empty list"
            return self._error(400, problem, "Bad Request", 400, param="body.messages")
        if not all(isinstance(m, dict) and "role" in m for m in messages):
            problem = "each message needs a 'role'"
            return self._error(400, problem, "Bad Request", 400, param="body.messages")
        if body.get("stream"):
            return self._error(400, "the fake does not stream", "BadRequestError", 400)
        refused = next((f for f in self.refuse_fields if f in body), None)
        if refused is not None:
            problem = f"Unrecognized request argument supplied: {refused}"
            return self._error(400, problem, "invalid_request_error", None)
        if self.check_tool_pairing and (problem := tool_pairing_error(messages)):
            return self._error(400, problem, "BadRequestError", 400)
        with self._lock:
            key = conversation_key(messages)
            attempt = self._attempts.get(key, 0) + 1
            self._attempts[key] = attempt

        fault = self.faults(body, attempt) if self.faults is not None else None
        if fault is not None:
            self._count("faulted")
        while isinstance(fault, Delay):
            await asyncio.sleep(fault.seconds)
            fault = fault.then
        if isinstance(fault, Status):
            return self._status_response(fault)
        if isinstance(fault, MalformedJSON):
            return web.Response(
                body=fault.body.encode(), status=200, content_type=fault.content_type
            )
        if isinstance(fault, Drop):
            return await self._drop(request, fault)
        return await self._complete(body, messages, usage=not isinstance(fault, NoUsage))

    def _error(
        self,
        status: int,
        message: str,
        type_: str,
        code: str | int | None,
        *,
        param: str | None = None,
    ) -> web.Response:
        """An error answer; ``param`` is vLLM's (only its style sends one)."""
        body = _error_body(message, type_, code, self.error_style, param)
        return web.json_response(body, status=status)

    def _status_response(self, fault: Status) -> web.Response:
        headers = {}
        if fault.retry_after is not None:
            value = fault.retry_after
            headers["Retry-After"] = str(int(value)) if float(value).is_integer() else str(value)
        if fault.raw_body is not None:
            return web.Response(
                text=fault.raw_body, status=fault.code, headers=headers, content_type="text/html"
            )
        return web.json_response(
            fault.error_body(self.error_style), status=fault.code, headers=headers
        )

    async def _drop(self, request: web.Request, fault: Drop) -> web.StreamResponse:
        self._dropping.add(id(request))
        self._count("dropped")
        transport = request.transport
        if fault.partial:
            response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
            response.content_length = 4096
            await response.prepare(request)
            await response.write(b'{"id": "chatcmpl-partial", "object": "chat.completion", ')
        if transport is not None:
            transport.close()
        # Closing the transport makes aiohttp cancel this handler (handler_cancellation);
        # the bounded sleep only guards against that not happening.
        await asyncio.sleep(5.0)
        raise ConnectionResetError("dropped by fault injection")

    async def _complete(
        self, body: dict[str, Any], messages: list[dict[str, Any]], *, usage: bool
    ) -> web.Response:
        vllm = self.dialect == "vllm"
        model = body.get("model") or self.model
        if self.strict_model and model != self.model:
            if vllm:
                problem = f"The model `{model}` does not exist. Valid aliases: {self.model}."
                return self._error(404, problem, "NotFoundError", 404, param="model")
            return self._error(404, f"The model `{model}` does not exist.", "404", 404)
        prompt_tokens = prompt_tokens_of(messages)
        limit = body.get("max_completion_tokens")
        if limit is None:
            limit = body.get("max_tokens")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
            return self._error(
                400, "max_tokens must be an integer", "BadRequestError", 400, param="max_tokens"
            )
        if limit is not None and limit < 1:
            problem = "max_tokens must be at least 1"
            if vllm:
                problem += f", got {limit}. (parameter=max_tokens, value={limit})"
            return self._error(400, problem, "BadRequestError", 400, param="max_tokens")
        if self.max_model_len is not None:
            if prompt_tokens >= self.max_model_len:
                fault = Status.context_length_exceeded(
                    self.max_model_len, prompt_tokens, dialect=self.dialect
                )
                return self._status_response(fault)
            if limit is not None and prompt_tokens + limit > self.max_model_len and not vllm:
                fault = Status.context_length_exceeded(
                    self.max_model_len, prompt_tokens + limit, limit
                )
                return self._status_response(fault)
            # What is left of the context: the default, and vLLM's clamp.
            left = self.max_model_len - prompt_tokens
            limit = left if limit is None else min(limit, left)

        n = self.completion_tokens_for(messages)
        finish_reason = "stop"
        if limit is not None and n > limit:
            n, finish_reason = limit, "length"

        rid = body.get("rid") if self.dialect == "sglang" else None
        rid = rid if isinstance(rid, str) else None
        decoded, admitted = await self._hold_slot(n, rid)
        if decoded < n:  # aborted by its rid: SGLang answers with what it had so far
            n, finish_reason = decoded, "abort"
            if not admitted:  # aborted in the queue: SGLang's usage is all 0
                prompt_tokens = 0

        text = last_user_text(messages)
        n_reasoning = min(self.reasoning_tokens, n) if self.reasoning else 0
        # The answer as the engine keeps it; the dialect's shape follows.
        answer: dict[str, Any] = {"role": "assistant"}
        tool = self._tool_to_call(body, messages)
        if tool is not None:
            # SGLang drops a call cut by max_tokens: nothing but the finish reason is left.
            answer["content"] = ""
            if finish_reason == "stop":
                answer["tool_calls"] = [_tool_call(tool, text, messages, self.dialect)]
                finish_reason = "tool_calls"
            n_reasoning = 0
        elif self.reasoning:
            answer["content"] = answer_for(text, n - n_reasoning) if n > n_reasoning else ""
            answer["reasoning_content"] = reasoning_for(text, n_reasoning)
        else:
            answer["content"] = answer_for(text, n)
        ids = None
        if body.get("return_token_ids") is True and self.token_ids_fn is not None:
            kept = dict(answer)
            if "tool_calls" in answer:  # the wire form: no index
                kept["tool_calls"] = [
                    {k: v for k, v in call.items() if k != "index"} for call in answer["tool_calls"]
                ]
            ids = self.token_ids_fn(body, kept)
        if vllm:
            reply = self._vllm_reply(model, answer, finish_reason, ids)
        else:
            reply = self._sglang_reply(model, answer, finish_reason, ids, n)
        if usage:
            reply["usage"] = self._usage(prompt_tokens, n, n_reasoning)
        if rid is not None:
            reply["id"] = rid  # SGLang's reply id is the request's rid
        if finish_reason == "abort":
            return web.json_response(reply)
        with self._lock:
            self._completed[conversation_key(messages)] += 1
            self._stats["completed"] += 1
            self._stats["completion_tokens"] += n
            self._stats["prompt_tokens"] += prompt_tokens
        return web.json_response(reply)

    def _usage(self, prompt_tokens: int, n: int, n_reasoning: int) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + n,
            "completion_tokens": n,
            "prompt_tokens_details": None,
        }
        if self.dialect == "vllm":
            usage["completion_tokens_details"] = {"reasoning_tokens": n_reasoning}
        else:
            usage["reasoning_tokens"] = n_reasoning
            usage["completion_tokens_details"] = (
                {"reasoning_tokens": n_reasoning} if n_reasoning else None
            )
        return usage

    def _sglang_reply(
        self,
        model: str,
        answer: dict[str, Any],
        finish_reason: str,
        ids: tuple[list[int], list[int]] | None,
        n: int,
    ) -> dict[str, Any]:
        message = {
            "role": "assistant",
            "content": answer["content"],
            "reasoning_content": answer.get("reasoning_content"),
        }
        if "tool_calls" in answer:
            message["tool_calls"] = answer["tool_calls"]
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": finish_reason,
            # SGLang: the end token's id when it stopped on it, a stop string when one matched.
            "matched_stop": EOS_TOKEN_ID if finish_reason == "stop" else None,
        }
        if ids is not None:
            choice["prompt_token_ids"], choice["response_token_ids"] = ids
        return {
            "id": f"chatcmpl-{next(self._ids)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "metadata": {
                "weight_version": "default",
                "weight_versions": [{"version": "default", "start": 0, "end": n}],
            },
        }

    def _vllm_reply(
        self,
        model: str,
        answer: dict[str, Any],
        finish_reason: str,
        ids: tuple[list[int], list[int]] | None,
    ) -> dict[str, Any]:
        content = answer["content"]
        reasoning = answer.get("reasoning_content")
        message: dict[str, Any] = {
            "role": "assistant",
            # vLLM: null when the parser left nothing after the reasoning.
            "content": None if reasoning and not content else content,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
        }
        if "tool_calls" in answer:
            message["tool_calls"] = answer["tool_calls"]
        message["reasoning"] = reasoning
        choice = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,  # a matched stop string or stop token id; the fake has none
            "token_ids": ids[1] if ids is not None else None,
            "routed_experts": None,
        }
        return {
            "id": f"chatcmpl-{next(self._ids):016x}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": "vllm-fake",
            "prompt_logprobs": None,
            "prompt_token_ids": ids[0] if ids is not None else None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    def _tool_to_call(
        self, body: dict[str, Any], messages: list[dict[str, Any]]
    ) -> dict[str, Any] | None:
        """The tool spec this request is answered with a call of, if any."""
        tools = body.get("tools")
        choice = body.get("tool_choice")
        if not self.call_tools or not isinstance(tools, list) or not tools or choice == "none":
            return None
        if messages[-1].get("role") != "user" and choice != "required":
            return None  # after tool results: answer
        name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        for tool in tools:
            function = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(function, dict) and (name is None or function.get("name") == name):
                return function
        return None

    async def _hold_slot(self, n_tokens: int, rid: str | None = None) -> tuple[int, bool]:
        """Queue for a slot (FIFO) and decode ``n_tokens`` in it; returns (tokens decoded,
        whether it got a slot): fewer tokens when it was aborted by its ``rid``.

        The engine's part runs in its own task (:meth:`_engine`), which outlives this
        handler: a client that goes away cancels the handler, and the engine notices at
        once (``disconnect_check_s`` 0) or at the request's next check, keeping its place
        in the queue or its slot until then."""
        work = _Work(
            n_tokens,
            time.monotonic(),
            asyncio.Event(),
            rid,
            prefill_s=self.base_latency_s,
            tokens_per_s=self.tokens_per_s,
        )
        self._works.add(work)
        if rid is not None:
            self._by_rid[rid] = work
        task = asyncio.ensure_future(self._engine(work))
        self._engine_tasks.add(task)
        task.add_done_callback(self._engine_tasks.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            work.client_gone = True
            check = self.disconnect_check_s
            if check <= 0 or task.done():
                work.stop.set()
            else:
                now = time.monotonic()
                noticed = work.arrived + check * (int((now - work.arrived) / check) + 1)
                asyncio.get_running_loop().call_later(noticed - now, work.stop.set)
            raise

    async def _engine(self, work: _Work) -> tuple[int, bool]:
        """The engine's side of one request: queued, then prefill and decode in a slot,
        until it is done or ``work.stop`` (aborted by its rid, or its client's absence
        noticed). Counts what it decoded when it leaves."""
        try:
            if not await self._until_slot(work):  # stopped while queued
                self._left(work, 0, cancelled=True, aborted=work.aborted)
                return 0, False
            decoded = await self._decode(work)
            stopped = decoded < work.n_tokens
            cancelled = stopped or work.client_gone
            self._left(work, decoded, cancelled=cancelled, aborted=stopped and work.aborted)
            return decoded, True
        finally:
            self._release(work)
            self._works.discard(work)
            if work.rid is not None and self._by_rid.get(work.rid) is work:
                del self._by_rid[work.rid]

    async def _until_slot(self, work: _Work) -> bool:
        """Wait for a slot (FIFO; ``work.admitted`` once it is ours); False when stopped
        first."""
        semaphore = self._semaphore
        if semaphore is None or not semaphore.locked():
            if semaphore is not None:
                await semaphore.acquire()
            self._admit(work)
            return True
        self._gauge("queued", +1)
        acquire = asyncio.ensure_future(semaphore.acquire())
        stopped = asyncio.ensure_future(work.stop.wait())
        try:
            await asyncio.wait([acquire, stopped], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not acquire.done():
                acquire.cancel()
                await asyncio.gather(acquire, return_exceptions=True)
            got = acquire.done() and not acquire.cancelled() and acquire.exception() is None
            self._gauge("queued", -1)
            if got:
                self._admit(work)  # even when cancelled now: the caller releases it
        if work.holding and work.stop.is_set():
            self._release(work)
            return False
        return work.holding

    def _admit(self, work: _Work) -> None:
        work.holding, work.admitted = True, time.monotonic()
        self._in_service.add(work)
        self._gauge("in_service", +1)

    async def _decode(self, work: _Work) -> int:
        """Hold the slot for the prefill (``base_latency_s``) and ``n_tokens`` of decode;
        stop early when ``work.stop`` is set. Returns the tokens decoded."""
        seconds = self.base_latency_s
        if self.tokens_per_s:
            seconds += work.n_tokens / self.tokens_per_s
        if seconds > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(work.stop.wait(), seconds)
        if not work.stop.is_set():
            return work.n_tokens
        return work.decoded_by(time.monotonic())

    def _release(self, work: _Work) -> None:
        if work.holding:
            work.holding = False
            self._in_service.discard(work)
            self._gauge("in_service", -1)
            if self._semaphore is not None:
                self._semaphore.release()

    def _left(self, work: _Work, decoded: int, *, cancelled: bool, aborted: bool) -> None:
        """``work`` leaves its slot (or the queue) with ``decoded`` tokens decoded;
        ``cancelled``: its client will not get them (gone, or aborted by its rid)."""
        self._release(work)
        with self._lock:
            self._stats["decoded_tokens"] += decoded
            if cancelled:
                self._stats["cancelled_decoded_tokens"] += decoded
                self._stats["cancelled_before_decode"] += decoded == 0
            self._stats["aborted"] += aborted

    def _live_decoded_tokens(self) -> int:
        """``decoded_tokens`` plus what the requests in their slots have decoded so far."""
        now = time.monotonic()
        with self._lock:
            done = self._stats["decoded_tokens"]
        return done + sum(work.decoded_by(now) for work in list(self._in_service))


@dataclass(eq=False)
class _Work:
    """One request in the engine: queued, then holding a slot from ``admitted``."""

    n_tokens: int
    arrived: float
    stop: asyncio.Event  # leave now: aborted by its rid, or its client's absence noticed
    rid: str | None = None
    aborted: bool = False  # by POST /abort_request (SGLang)
    client_gone: bool = False
    holding: bool = False
    admitted: float | None = None
    prefill_s: float = 0.0
    tokens_per_s: float | None = None

    def decoded_by(self, now: float) -> int:
        """Tokens decoded by ``now``: none before the slot and the prefill, then
        ``tokens_per_s`` (all at once without it), at most ``n_tokens``."""
        if self.admitted is None or now < self.admitted + self.prefill_s:
            return 0
        if not self.tokens_per_s:
            return self.n_tokens
        return min(self.n_tokens, int((now - self.admitted - self.prefill_s) * self.tokens_per_s))


class FakeOpenAIServer(FakeOpenAI):
    """:class:`FakeOpenAI` on its own event loop in a background thread.

    ``with FakeOpenAIServer(**options) as server:`` starts it on 127.0.0.1 with an
    OS-assigned port (or ``port=``); ``server.url`` is the ``/v1`` base URL.
    ``start_thread`` / ``stop_thread`` do the same without ``with``.
    """

    def __init__(self, *, port: int = 0, **options: Any) -> None:
        super().__init__(**options)
        self._port_wanted = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> FakeOpenAIServer:
        self.start_thread()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop_thread()

    def start_thread(self, timeout: float = 10.0) -> str:
        if self._thread is not None:
            raise RuntimeError("already started")
        loop = asyncio.new_event_loop()
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.start(self._port_wanted))
            except BaseException as exc:
                failure.append(exc)
                started.set()
                loop.close()
                return
            started.set()
            try:
                loop.run_forever()
            finally:
                _cancel_all(loop)
                loop.close()

        thread = threading.Thread(target=run, name="fake-openai", daemon=True)
        thread.start()
        if not started.wait(timeout):
            raise TimeoutError("fake OpenAI server did not start")
        if failure:
            thread.join(timeout)
            raise failure[0]
        self._loop, self._thread = loop, thread
        return self.url

    def stop_thread(self, timeout: float = 10.0) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self.stop(), loop).result(timeout)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout)
            self._loop = self._thread = None


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.wait(tasks, timeout=2.0))


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------

_CLI_FAULTS: dict[str, Callable[[argparse.Namespace], Fault]] = {
    "500": lambda a: Status.server_error(),
    "503": lambda a: Status.overloaded(),
    "429": lambda a: Status.rate_limited(a.retry_after),
    "408": lambda a: Status.request_timeout(),
    "drop": lambda a: Drop(),
    "partial": lambda a: Drop(partial=True),
    "malformed": lambda a: MalformedJSON(),
    "no-usage": lambda a: NoUsage(),
    "delay": lambda a: Delay(a.fault_delay),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Fake OpenAI-compatible chat server on 127.0.0.1 (see module docstring).",
    )
    p.add_argument("--port", type=int, default=0, help="port (0: any free port)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--api-key", default=None)
    p.add_argument("--slots", type=int, default=None, help="requests in service at once")
    p.add_argument("--tokens-per-s", type=float, default=None, help="per-slot speed")
    p.add_argument("--base-latency-s", type=float, default=0.0, help="prefill per request")
    p.add_argument(
        "--disconnect-check-s",
        type=float,
        default=0.0,
        help="a closed connection is noticed at the next multiple of this since the request "
        "arrived (SGLang: 4); 0: at once (vLLM)",
    )
    p.add_argument("--mean-tokens", type=int, default=40)
    p.add_argument("--token-spread", type=int, default=None, help="default mean/4")
    p.add_argument("--reasoning", action="store_true")
    p.add_argument("--reasoning-tokens", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--strict-model", action="store_true")
    p.add_argument("--call-tools", action="store_true", help="answer offered tools with a call")
    p.add_argument("--dialect", choices=DIALECTS, default="sglang", help="whose shapes")
    p.add_argument("--error-style", choices=ERROR_STYLES, default=None, help="the dialect's")
    p.add_argument("--fault-rate", type=float, default=0.0, help="fraction of conversations")
    p.add_argument("--fault", choices=sorted(_CLI_FAULTS), default="503")
    p.add_argument("--fault-attempts", type=int, default=1, help="faulted attempts each")
    p.add_argument("--fault-delay", type=float, default=30.0, help="seconds, for --fault delay")
    p.add_argument("--retry-after", type=float, default=None, help="for --fault 429")
    p.add_argument("--backlog", type=int, default=4096)
    return p


def _raise_fd_limit() -> None:
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = hard if hard != resource.RLIM_INFINITY else 65536
        if soft != resource.RLIM_INFINITY and soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (ImportError, ValueError, OSError):  # pragma: no cover - platform specific
        pass


async def _serve(args: argparse.Namespace) -> None:
    faults = None
    if args.fault_rate > 0:
        faults = hashed_faults(args.fault_rate, _CLI_FAULTS[args.fault](args), args.fault_attempts)
    server = FakeOpenAI(
        model=args.model,
        api_key=args.api_key,
        mean_tokens=args.mean_tokens,
        token_spread=args.token_spread,
        reasoning=args.reasoning,
        reasoning_tokens=args.reasoning_tokens,
        faults=faults,
        slots=args.slots,
        tokens_per_s=args.tokens_per_s,
        base_latency_s=args.base_latency_s,
        disconnect_check_s=args.disconnect_check_s,
        max_model_len=args.max_model_len,
        strict_model=args.strict_model,
        call_tools=args.call_tools,
        dialect=args.dialect,
        error_style=args.error_style,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    url = await server.start(args.port, backlog=args.backlog)
    print(f"READY {url}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()
        print("STATS " + json.dumps(server.stats), file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _raise_fd_limit()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
