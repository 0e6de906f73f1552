"""Generation against OpenAI-compatible servers (SGLang, vLLM, llama.cpp).

One long-lived ``aiohttp`` session serves every request: aiohttp keeps
hundreds of concurrent connections cheaply in one event loop (httpx's pool is
notably slower at that scale, and the openai SDK would add a client object and
its own retry policy per call). Requests are spread over the endpoints by
fewest-in-flight; an endpoint that keeps failing is paused and retried later.

Failures are classified, because they mean different things for the data:

* permanent (4xx other than 408/429, e.g. context too long): the prompt is
  recorded as failed with the server's message and skipped in the prefix;
* transient (connection errors, timeouts, 408/429/5xx, unreadable bodies):
  retried with exponential backoff and jitter; if still failing, the prompt is
  left for a later dispatch and counts towards the run's error limits.

Tool calling: a conversation's ``tools`` go in the body and its history in wire format
(assistant ``tool_calls``, tool ``tool_call_id``/``name``); the server renders them with
the model's template and, started with the model's ``--tool-call-parser`` (SGLang; vLLM:
``--enable-auto-tool-choice --tool-call-parser``), returns the calls it parsed in
``message.tool_calls``, which become :attr:`Completion.tool_calls` (``arguments`` kept as
the JSON string servers send). ``finish_reason: "tool_calls"`` is an ordinary finish.
A server without a parser leaves the call markup in ``content``, like the in-process engine.

Reasoning: servers started with a reasoning parser send it apart from the content, SGLang
in ``message.reasoning_content``, vLLM in ``message.reasoning``; both become
:attr:`Completion.reasoning_content`.

Token ids: every request asks for ``return_token_ids`` (``generation.return_token_ids``),
and the ids SGLang and vLLM return, the prompt as the server rendered and tokenized it and
the completion as generated, become :attr:`Completion.prompt_ids` and ``completion_ids``
(:func:`eagle3data.servers.openai_chat.token_ids_of`); a server that returns none leaves
them None. An endpoint that refuses the field (a 4xx naming it) or returns ids in a shape we
do not know is asked in text from then on, with one warning (:attr:`OpenAIEngine.notes`):
the refused request is sent again without the field, the answer with odd ids is kept without
them, and the tokenize stage re-renders turns without ids. Neither fails a prompt.

The context: a prompt that does not fit the target's context is a permanent failure of
kind :data:`OVER_CONTEXT`. SGLang answers it with a 400 (so do vLLM and llama.cpp for a
prompt longer than the context); vLLM 0.32 instead cuts ``max_tokens`` to what the context
has left (``get_max_tokens``) and answers a short ``finish_reason: length``. Such an
answer, one that stopped before ``max_tokens`` where prompt and completion reach the
endpoint's ``max_model_len`` (its ``/models`` entry; SGLang and vLLM report it), is
recorded as over-context too, not kept as short data; the tokens it cost are the run's
waste (:attr:`TurnFailure.spent_tokens`).

A vLLM capture server (``hidden_states.backend: vllm``) that also generates writes the
hidden states of every generation request too, and names the file in
``kv_transfer_params.hidden_states_path``: where that path is on this machine, the file is
deleted as soon as vLLM has written it (:mod:`eagle3data.servers.vllm_files`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential_jitter,
)

from ...errors import EngineUnavailable
from ...images import ImageSource, data_uri
from ...schema import from_schema
from ...servers.http import (
    RETRY_STATUS,
    TransientError,
    error_message,
    json_or_none,
    models_entry,
    served_context_length,
)
from ...servers.openai_chat import (
    TOKEN_IDS_FIELD,
    UnknownTokenIds,
    aborted_decode,
    parse_tool_calls,
    reasoning_of,
    refuses_token_ids,
    request_body,
    says_over_context,
    server_root,
    token_ids_of,
    without_token_ids,
)
from ...servers.queue import ServerQueue, gauge_for
from ...servers.vllm_files import discard_states
from .endpoint_pool import Endpoint, EndpointPool, Lease
from .protocol import (
    CURRENT_REQUEST,
    OVER_CONTEXT,
    Completion,
    Message,
    RequestTrace,
    Tools,
    TurnFailure,
)

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 10.0  # for SGLang to take an abort and answer the aborted request
QUEUE_TIMEOUT = aiohttp.ClientTimeout(total=2.0)  # a queue gauge late by more is stale


@dataclass(frozen=True)
class HttpSettings:
    endpoints: Sequence[str]
    model: str
    concurrency: int = from_schema("generation", "concurrency")  # requests in flight per endpoint
    api_key: str | None = None
    request_timeout_s: float = from_schema("generation", "request_timeout_s")
    connect_timeout_s: float = 10.0
    max_retries: int = from_schema("generation", "max_retries")
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 60.0
    endpoint_max_failures: int = 5  # consecutive failures before an endpoint is paused
    endpoint_pause_s: float = 30.0
    health_check_timeout_s: float = 10.0
    extra_body: Mapping[str, Any] = from_schema("generation", "extra_body")
    # Ask for the ids of each turn (see token_ids_of).
    return_token_ids: bool = from_schema("generation", "return_token_ids")
    # Where the run's endpoint slots are (:mod:`.endpoint_slots`): ``concurrency`` is then
    # shared with every other job of the run that uses them; None: this engine's own.
    slot_dir: str | None = None


def failure_kind(message: str) -> str | None:
    """OVER_CONTEXT for a server's error that says the request does not fit its context."""
    return OVER_CONTEXT if says_over_context(message) else None


class OpenAIEngine:
    """Async engine: ``await complete(messages)`` gives the next assistant turn."""

    def __init__(
        self,
        settings: HttpSettings,
        *,
        sampling: Mapping[str, Any],
        seed: int,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        count_tokens: Any = None,
        images: ImageSource | None = None,
    ) -> None:
        if not settings.endpoints:
            raise EngineUnavailable("generation.endpoints is empty: name at least one server URL")
        self.settings = settings
        self.sampling = dict(sampling)
        self.seed = seed
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.count_tokens = count_tokens  # fallback when a server reports no usage
        self.images = images  # where image parts' bytes are read; None: text prompts only
        self.pool = EndpointPool(
            settings.endpoints,
            settings.concurrency,
            settings.endpoint_max_failures,
            settings.endpoint_pause_s,
            settings.slot_dir,
        )
        self._session: aiohttp.ClientSession | None = None
        self.token_ids_fallbacks = 0  # endpoints asked in text after refusing the ids
        # Hidden-state files a capture server wrote for our requests that we could not
        # delete (its storage not visible here, or not ours to delete): warned once each.
        self.capture_files_left = 0
        self.gauge_readings = 0  # times the servers' queue gauges were read (benchmarks)
        self._left_warned: set[tuple[str, str]] = set()

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    @property
    def notes(self) -> dict[str, int]:
        """Counters about the servers, for the stats: ``token_ids_fallbacks``, endpoints
        that refused ``return_token_ids`` or sent ids in a shape we do not know."""
        return {
            "token_ids_fallbacks": self.token_ids_fallbacks,
            "capture_files_left": self.capture_files_left,
        }

    @property
    def shares_slots(self) -> bool:
        """Whether each endpoint's ``concurrency`` is shared with the run's other jobs: the
        driver then sends a conversation only with room for it (:meth:`take_slots`)."""
        return self.pool.shared

    def take_slots(self, n: int) -> list[Lease]:
        """Room for up to ``n`` requests now, without waiting: each goes with one new
        conversation (:attr:`RequestTrace.slot`), whose first request uses it; one not used
        comes back through :meth:`return_slot`."""
        return self.pool.take(n)

    def return_slot(self, lease: Lease) -> None:
        self.pool.give_back(lease)

    @property
    def reports_queues(self) -> bool:
        """Whether some endpoint reports its running and waiting requests."""
        return any(e.queue_gauge is not None for e in self.pool.endpoints)

    async def server_queues(self) -> dict[str, ServerQueue]:
        """Each endpoint's queue as its own gauge says now (endpoints that report one and
        answered in time; :mod:`eagle3data.servers.queue`), by endpoint URL."""
        assert self._session is not None, "call start() first"
        self.gauge_readings += 1
        asking = [e for e in self.pool.endpoints if e.queue_gauge is not None]
        answers = await asyncio.gather(*(self._server_queue(e) for e in asking))
        return {e.url: q for e, q in zip(asking, answers, strict=True) if q is not None}

    async def _server_queue(self, endpoint: Endpoint) -> ServerQueue | None:
        assert self._session is not None and endpoint.queue_gauge is not None
        url = server_root(endpoint.url) + endpoint.queue_gauge.route
        try:
            async with self._session.get(url, timeout=QUEUE_TIMEOUT) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.debug("queue of %s: %s", endpoint.url, exc)
            return None
        queue = endpoint.queue_gauge.parse(text) if resp.status == 200 else None
        if queue is None:
            # Not what the server's version sends: plan without it from now on.
            log.warning(
                "%s: GET %s answered HTTP %d without the queue gauges we read; planning "
                "without its queue from now on",
                endpoint.url,
                url,
                resp.status,
            )
            endpoint.queue_gauge = None
        return queue

    def _fall_back_to_text(self, endpoint: Endpoint, why: str) -> None:
        """Ask ``endpoint`` without ``return_token_ids`` from now on; warn once."""
        if not endpoint.token_ids:
            return
        endpoint.token_ids = False
        self.token_ids_fallbacks += 1
        log.warning(
            "%s does not take %s (%s): asking it in text from now on; its turns keep no "
            "token ids and the tokenize stage re-renders them",
            endpoint.url,
            TOKEN_IDS_FIELD,
            why,
        )

    async def _discard_captured_states(self, payload: Any, endpoint: Endpoint) -> None:
        """Delete the hidden states a vLLM capture server wrote for a generation request
        (57 KB a token at Kimi-K2.5's width): one left behind is counted, and warned of
        once per endpoint and cause, never silently."""
        params = payload.get("kv_transfer_params") if isinstance(payload, dict) else None
        path = params.get("hidden_states_path") if isinstance(params, dict) else None
        if not isinstance(path, str) or not path:
            return
        outcome = await asyncio.to_thread(discard_states, path)
        if outcome == "deleted":
            return
        self.capture_files_left += 1
        if (endpoint.url, outcome) in self._left_warned:
            return
        self._left_warned.add((endpoint.url, outcome))
        why = (
            "is not on this machine (the server's storage is not visible to this job)"
            if outcome == "absent"
            else "may not be deleted by this user (the server runs as another)"
        )
        log.warning(
            "%s captures hidden states for generation requests, and the file it wrote "
            "(%s) %s: every request leaves one behind there. Generate against a server "
            "without the hidden-states connector, or run the generate jobs where its "
            "storage is theirs; the stats count the files left (capture_files_left)",
            endpoint.url,
            path,
            why,
        )

    async def start(self) -> None:
        headers = {"Content-Type": "application/json"}
        if self.settings.api_key:
            headers["Authorization"] = f"Bearer {self.settings.api_key}"
        self._session = aiohttp.ClientSession(
            headers=headers,
            trace_configs=[_InOrder.trace_config()],
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(
                total=self.settings.request_timeout_s, connect=self.settings.connect_timeout_s
            ),
        )
        self.pool.open_slots()
        await self._health_check()

    async def close(self) -> None:
        self.pool.close_slots()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _health_check(self) -> None:
        """Fail in seconds, naming every URL and what it answered, if none works."""
        assert self._session is not None
        problems = []
        timeout = aiohttp.ClientTimeout(total=self.settings.health_check_timeout_s)
        for endpoint in self.pool.endpoints:
            url = f"{endpoint.url}/models"
            try:
                async with self._session.get(url, timeout=timeout) as resp:
                    text = await resp.text()
                    if resp.status == 200:
                        payload = json_or_none(text)
                        entry = models_entry(payload, self.settings.model)
                        endpoint.max_model_len = served_context_length(entry)
                        owner = entry.get("owned_by")
                        # SGLang takes a request id (rid) and aborts it on /abort_request.
                        endpoint.abortable = owner == "sglang"
                        endpoint.queue_gauge = gauge_for(owner)
                        continue
                    problems.append(f"GET {url} -> HTTP {resp.status}: {text[:200]}")
            except (aiohttp.ClientError, TimeoutError) as exc:
                problems.append(f"GET {url} -> {type(exc).__name__}: {exc}")
            endpoint.paused_until = time.monotonic() + self.settings.endpoint_pause_s
        if len(problems) == len(self.pool.endpoints):
            raise EngineUnavailable(
                "no generation endpoint is usable:\n" + "\n".join(f"  {p}" for p in problems)
            )
        for p in problems:
            log.warning("endpoint unusable at start, paused: %s", p)

    def _image_url(self, sha256: str) -> str:
        """An image part as a data URI: the server needs no access to our files."""
        assert self.images is not None
        return data_uri(self.images.get(sha256), self.images.info(sha256).mime)

    async def complete(
        self, messages: Sequence[Message], tools: Tools | None = None
    ) -> Completion | TurnFailure:
        body = request_body(
            messages,
            model=self.settings.model,
            sampling=self.sampling,
            seed=self.seed,
            chat_template_kwargs=self.chat_template_kwargs,
            extra_body=self.settings.extra_body,
            tools=tools,
            return_token_ids=self.settings.return_token_ids,
            image_url=None if self.images is None else self._image_url,
        )
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(TransientError),
            stop=stop_after_attempt(self.settings.max_retries + 1),
            wait=wait_exponential_jitter(
                multiplier=self.settings.backoff_initial_s,
                max=self.settings.backoff_max_s,
                jitter=self.settings.backoff_initial_s,
            ),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await self._post(body)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _post(self, body: dict[str, Any]) -> Completion | TurnFailure:
        assert self._session is not None, "call start() first"
        trace = CURRENT_REQUEST.get()
        lease = trace.slot if trace is not None else None
        if trace is not None:
            trace.slot = None  # taken by the driver for the conversation's first request
        if lease is None:
            lease = await self.pool.acquire()
        endpoint = lease.endpoint
        healthy: bool | None = False
        try:
            url = f"{endpoint.url}/chat/completions"
            while True:  # twice at most: again in text when the endpoint refused the ids
                sent = body if endpoint.token_ids else without_token_ids(body)
                if endpoint.abortable:
                    sent = {**sent, "rid": f"eagle3data-{uuid.uuid4().hex}"}
                if trace is not None:
                    trace.endpoint, trace.sent_at = endpoint.url, time.monotonic()
                status, text = await self._send_cancellable(endpoint, url, sent, trace)
                payload = json_or_none(text)
                if status in RETRY_STATUS:
                    raise TransientError(f"{url}: HTTP {status}: {error_message(payload, text)}")
                healthy = True  # the server answered; what it said is about the request
                if status == 200:
                    break
                message = error_message(payload, text)
                if not refuses_token_ids(sent, status, f"{message} {text}"):
                    return TurnFailure(f"HTTP {status}: {message}", kind=failure_kind(message))
                self._fall_back_to_text(endpoint, f"HTTP {status}: {message}")
            if payload is None:
                healthy = False
                raise TransientError(f"{url}: HTTP 200 with a body that is not JSON")
            await self._discard_captured_states(payload, endpoint)
            return self._completion(payload, endpoint)
        except asyncio.CancelledError:
            healthy = None  # we hung up (a stop, or the budget is reached): no verdict
            raise
        finally:
            await self.pool.release(lease, healthy=healthy)

    async def _send_cancellable(
        self, endpoint: Endpoint, url: str, body: Mapping[str, Any], trace: RequestTrace | None
    ) -> tuple[int, str]:
        """:meth:`_send`, cancelled the way the server frees the request soonest.

        Cancelling the caller closes the connection, which vLLM notices at once. SGLang
        notices a closed connection of a non-streaming request only every 4 s
        (``SGLANG_REQUEST_STATE_WAIT_TIMEOUT``) and decodes on meanwhile, so a request to
        SGLang is aborted by its ``rid`` instead (queued requests leave the queue, running
        ones stop at the next step), and its answer, which SGLang then sends at once, says
        how many tokens it had decoded: :attr:`RequestTrace.decoded_on_cancel` (a request
        that finished before the abort arrived answers as usual: its usage counts the same)."""
        order = _InOrder(endpoint.send_order)
        sending = asyncio.ensure_future(self._send(url, body, order))
        try:
            return await asyncio.shield(sending)
        except asyncio.CancelledError:
            rid = body.get("rid")
            # Not written yet: the server has nothing of it, and an abort by rid sent now
            # would arrive before the request it names (a no-op there), so just cancel.
            if not endpoint.abortable or not isinstance(rid, str) or not order.is_written:
                if trace is not None and not order.is_written:
                    trace.decoded_on_cancel = 0
                sending.cancel()  # closes the connection
                await asyncio.gather(sending, return_exceptions=True)
                raise
            # Shielded: the driver waits for the cancelled tasks, and this is short.
            decoded = await asyncio.shield(self._abort(endpoint, rid, sending))
            if trace is not None:
                trace.decoded_on_cancel = decoded
            raise

    async def _send(
        self, url: str, body: Mapping[str, Any], order: _InOrder | None = None
    ) -> tuple[int, str]:
        """POST ``body``: the status and the text of the answer. With ``order``, the
        request reaches its endpoint after every one sent to it before (:class:`_InOrder`)."""
        assert self._session is not None, "call start() first"
        try:
            if order is not None:
                await order.take_turn()
            async with self._session.post(url, json=body, trace_request_ctx=order) as resp:
                if order is not None:
                    order.written()  # the answer has begun: the request is surely out
                return resp.status, await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise TransientError(f"{url}: {type(exc).__name__}: {exc}") from exc
        finally:
            if order is not None:
                order.give_up()

    async def _abort(
        self, endpoint: Endpoint, rid: str, sending: asyncio.Future[tuple[int, str]]
    ) -> int | None:
        """Abort ``rid`` on SGLang and read what its answer says it decoded; None when the
        server did not say (the abort or the answer failed, or took too long)."""
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=ABORT_TIMEOUT_S)
        try:
            async with self._session.post(
                f"{server_root(endpoint.url)}/abort_request", json={"rid": rid}, timeout=timeout
            ) as resp:
                await resp.read()
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(
                        resp.request_info, (), status=resp.status, message="abort refused"
                    )
            status, text = await asyncio.wait_for(asyncio.shield(sending), ABORT_TIMEOUT_S)
        except (aiohttp.ClientError, TimeoutError, TransientError) as exc:
            log.debug("abort of %s on %s: %s", rid, endpoint.url, exc)
            sending.cancel()
            return None
        return aborted_decode(status, json_or_none(text))

    def _completion(self, payload: dict[str, Any], endpoint: Endpoint) -> Completion | TurnFailure:
        url = f"{endpoint.url}/chat/completions"
        try:
            choice = payload["choices"][0]
            message = choice["message"]
            content = message.get("content") or ""
            reasoning = reasoning_of(message)
            tool_calls = parse_tool_calls(message.get("tool_calls"))
            finish = choice.get("finish_reason") or "unknown"
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
            raise TransientError(f"{url}: unexpected response shape ({exc!r})") from None
        try:
            ids = token_ids_of(payload, choice)
        except UnknownTokenIds as exc:  # the answer is good; only its ids are not usable
            self._fall_back_to_text(endpoint, f"token ids in a shape we do not know: {exc}")
            ids = None
        if finish == "abort":  # SGLang: the scheduler dropped the request; ask again
            raise TransientError(f"{url}: generation aborted by the server")
        usage = payload.get("usage") or {}
        completion_tokens = usage.get("completion_tokens")
        prompt_tokens = usage.get("prompt_tokens", 0)
        usage_source = "server"
        if completion_tokens is None:
            if self.count_tokens is None:
                raise TransientError(f"{url}: response has no usage and no tokenizer to count")
            completion_tokens = self.count_tokens(
                (reasoning or "") + content + _calls_text(tool_calls)
            )
            usage_source = "tokenizer"
        completion = Completion(
            content=content,
            finish_reason=finish,
            prompt_tokens=int(prompt_tokens or 0),
            completion_tokens=int(completion_tokens),
            reasoning_content=reasoning,
            usage_source=usage_source,
            tool_calls=tool_calls,
            prompt_ids=ids[0] if ids else None,
            completion_ids=ids[1] if ids else None,
        )
        cut = cut_by_context(completion, endpoint.max_model_len, self.sampling["max_tokens"])
        if cut is not None:
            return TurnFailure(cut, kind=OVER_CONTEXT, spent_tokens=completion.completion_tokens)
        return completion


class _InOrder:
    """One request's turn in its endpoint's send order: taken before the request is sent,
    given up once its body is written (aiohttp's ``on_request_chunk_sent`` trace), or when
    its answer begins or it fails, whichever comes first.

    Why: a burst of requests opens new connections whose setup times vary, so without a
    turn they reach the server out of the order they were sent in. Servers run first come,
    first served, and the budget's prefix needs the earliest positions first; the queue
    gauges (:func:`eagle3data.servers.queue.queued_positions`) also read a server's waiting requests
    as this client's newest. Holding a turn costs one write per request."""

    def __init__(self, lock: asyncio.Lock) -> None:
        self._lock = lock
        self._holding = False
        self.is_written = False

    async def take_turn(self) -> None:
        await self._lock.acquire()
        self._holding = True

    def written(self) -> None:
        if self._holding:
            self.is_written = True
        self.give_up()

    def give_up(self) -> None:
        """The turn ends whether or not the request was written (it failed or stopped)."""
        if self._holding:
            self._holding = False
            self._lock.release()

    @staticmethod
    def trace_config() -> aiohttp.TraceConfig:
        async def chunk_sent(_: Any, context: Any, __: Any) -> None:
            order = context.trace_request_ctx
            if isinstance(order, _InOrder):
                order.written()

        config = aiohttp.TraceConfig()
        config.on_request_chunk_sent.append(chunk_sent)
        return config


def cut_by_context(completion: Completion, context: int | None, max_tokens: int) -> str | None:
    """Why ``completion`` is an answer the server cut where its context ended, or None.

    vLLM 0.32 answers a prompt that fits only without its ``max_tokens`` by lowering
    ``max_tokens`` to what the context has left: ``finish_reason: length`` before
    ``max_tokens``, prompt and completion together reaching ``max_model_len``. SGLang
    refuses the same request (a 400); both are over-context. Without a reported context,
    or without the server's own usage, nothing is judged: keeping a short answer is
    safer than dropping a good one."""
    if context is None or completion.usage_source != "server":
        return None
    used = completion.prompt_tokens + completion.completion_tokens
    if completion.finish_reason != "length" or completion.completion_tokens >= max_tokens:
        return None
    if used < context:
        return None
    return (
        f"over context: the prompt's {completion.prompt_tokens} tokens leave "
        f"{completion.completion_tokens} of max_tokens {max_tokens} in the server's "
        f"max_model_len {context} (it cut the answer there)"
    )


def _calls_text(tool_calls: list[dict[str, Any]] | None) -> str:
    """The calls' names and arguments: what a usage-less count can see of the markup."""
    return "".join(c["function"]["name"] + c["function"]["arguments"] for c in tool_calls or [])
