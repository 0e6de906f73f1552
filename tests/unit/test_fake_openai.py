"""The fake OpenAI server behaves like a real one, and its faults look like real faults."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from support.fake_openai import (
    EOS_TOKEN_ID,
    UNBOUNDED_CONTEXT,
    Delay,
    Drop,
    FakeOpenAIServer,
    FaultPlan,
    MalformedJSON,
    NoUsage,
    Status,
    build_parser,
    hashed_faults,
)
from support.real_servers import json_shape, load_recorded
from support.sglang_server import RECORDED_DIR as SGLANG_RECORDED
from support.vllm_server import RECORDED_DIR as VLLM_RECORDED
from support.workflow import REPO

FAKE = REPO / "tests" / "support" / "fake_openai.py"


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": text}], **extra}


def post(
    url: str, body: dict[str, Any], *, timeout: float = 5.0, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """POST JSON with urllib; HTTP errors are returned, not raised."""
    request = urllib.request.Request(
        url + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, dict(exc.headers), exc.read()


def get_json(url: str, headers: dict[str, str] | None = None) -> Any:
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())


def wait_until(predicate: Callable[[], bool], timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_deterministic_replies_and_usage() -> None:
    with FakeOpenAIServer(mean_tokens=40) as server:
        assert get_json(server.url + "/models") == {
            "object": "list",
            "data": [
                {
                    "id": "fake-model",
                    "object": "model",
                    "created": 0,
                    "owned_by": "sglang",  # the dialect's server, as SGLang says
                    "root": "fake-model",
                    "parent": None,
                    "max_model_len": UNBOUNDED_CONTEXT,
                }
            ],
        }
        replies = []
        for text in ("What is 2 plus 2?", "What is 2 plus 2?", "Name a colour."):
            status, _, raw = post(server.url, chat(text, temperature=0.7, max_tokens=1000))
            assert status == 200
            replies.append(json.loads(raw))
        first, again, other = replies
        assert first["object"] == "chat.completion"
        assert first["model"] == "fake-model"
        assert first["id"] != again["id"]
        assert first["choices"] == again["choices"]
        assert first["usage"] == again["usage"]
        assert (
            first["choices"][0]["message"]["content"] != other["choices"][0]["message"]["content"]
        )

        choice = first["choices"][0]
        assert choice["index"] == 0
        assert choice["finish_reason"] == "stop"
        assert choice["matched_stop"] == EOS_TOKEN_ID and choice["logprobs"] is None
        assert choice["message"]["role"] == "assistant"
        assert choice["message"]["reasoning_content"] is None
        content = choice["message"]["content"]
        assert content.startswith("Answer to: What is 2 plus 2? Answer to:")
        usage = first["usage"]
        assert usage["completion_tokens"] == len(content.split())
        assert 30 <= usage["completion_tokens"] <= 50  # 40 ± 40 // 4
        assert usage["prompt_tokens"] == 5 + 1
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["reasoning_tokens"] == 0 and usage["completion_tokens_details"] is None
        assert usage["completion_tokens"] == server.completion_tokens_for(
            chat("What is 2 plus 2?")["messages"]
        )

        assert len(server.requests) == 3
        assert server.requests[0]["temperature"] == 0.7
        stats = server.stats
        assert (stats["received"], stats["completed"], stats["errors"]) == (3, 3, 0)
        assert stats["completion_tokens"] == sum(r["usage"]["completion_tokens"] for r in replies)


def test_max_tokens_caps_with_finish_reason_length() -> None:
    with FakeOpenAIServer(mean_tokens=40, token_spread=0) as server:
        for field in ("max_tokens", "max_completion_tokens"):
            reply = json.loads(post(server.url, chat("Hello there", **{field: 3}))[2])
            assert reply["choices"][0]["finish_reason"] == "length"
            assert reply["choices"][0]["message"]["content"] == "Answer to: Hello"
            assert reply["usage"]["completion_tokens"] == 3
        reply = json.loads(post(server.url, chat("Hello there", max_tokens=40))[2])
        assert reply["choices"][0]["finish_reason"] == "stop"
        assert reply["usage"]["completion_tokens"] == 40
        status, _, raw = post(server.url, chat("Hello there", max_tokens=0))
        assert status == 400 and json.loads(raw)["object"] == "error"


def test_reasoning_content_counts_in_completion_tokens() -> None:
    with FakeOpenAIServer(reasoning=True, reasoning_tokens=4, tokens_fn=lambda m: 10) as server:
        message = json.loads(post(server.url, chat("Why?"))[2])["choices"][0]["message"]
        assert message["reasoning_content"] == "Thinking about: Why? Thinking"
        assert message["content"] == "Answer to: Why? Answer to: Why?"
        capped = json.loads(post(server.url, chat("Why?", max_tokens=3))[2])
        assert capped["choices"][0]["message"]["content"] == ""  # SGLang: never null
        assert capped["usage"]["reasoning_tokens"] == 3
        assert capped["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}
        assert capped["choices"][0]["message"]["reasoning_content"] == "Thinking about: Why?"
        assert capped["choices"][0]["finish_reason"] == "length"


def test_api_key_required_when_configured() -> None:
    with FakeOpenAIServer(api_key="sekret") as server:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            status, _, raw = post(server.url, chat("hi"), headers=headers)
            assert status == 401
            assert json.loads(raw) == {"error": "Unauthorized"}
        status, _, _ = post(server.url, chat("hi"), headers={"Authorization": "Bearer sekret"})
        assert status == 200
        with pytest.raises(urllib.error.HTTPError) as info:
            get_json(server.url + "/models")
        info.value.close()
        assert info.value.code == 401
        assert get_json(server.url + "/models", {"Authorization": "Bearer sekret"})["data"]


def test_status_faults_have_sglang_error_bodies() -> None:
    plan = FaultPlan(
        {
            "a": [Status.server_error()],
            "b": [Status.overloaded()],
            "c": [Status.rate_limited(retry_after=2)],
            "d": [Status.request_timeout()],
            "e": [Status.context_length_exceeded(limit=4096, requested=5000)],
            "f": [Status(502, raw_body="<html>Bad Gateway</html>")],
        }
    )
    with FakeOpenAIServer(faults=plan) as server:
        seen = {text: post(server.url, chat(text)) for text in "abcdef"}
        assert {text: s[0] for text, s in seen.items()} == dict(
            a=500, b=503, c=429, d=408, e=400, f=502
        )
        error = json.loads(seen["e"][2])
        assert error == {
            "object": "error",
            "message": "The input (5000 tokens) is longer than the model's context length "
            "(4096 tokens).",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
        assert json.loads(seen["a"][2])["type"] == "500"
        assert json.loads(seen["b"][2])["code"] == 503
        assert json.loads(seen["c"][2])["code"] == "rate_limit_exceeded"
        assert seen["c"][1]["Retry-After"] == "2"
        assert seen["f"][2] == b"<html>Bad Gateway</html>"
        assert server.stats["errors"] == 6
        # second attempts succeed
        assert post(server.url, chat("a"))[0] == 200


def test_real_context_length_check() -> None:
    with FakeOpenAIServer(max_model_len=20, tokens_fn=lambda m: 50) as server:
        status, _, raw = post(server.url, chat("one two three", max_tokens=30))
        assert status == 400
        assert json.loads(raw)["message"].startswith(
            "Requested token count exceeds the model's maximum context length of 20 tokens. "
            "You requested a total of 34 tokens: 4 tokens from the input messages and 30 "
        )
        reply = json.loads(post(server.url, chat("one two three"))[2])
        assert reply["usage"]["completion_tokens"] == 20 - 4
        assert reply["choices"][0]["finish_reason"] == "length"


def test_delay_makes_client_time_out_and_counts_cancelled() -> None:
    plan = FaultPlan({"slow": [Delay(3.0), Delay(0.2, then=Status.overloaded())]})
    with FakeOpenAIServer(faults=plan) as server:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            post(server.url, chat("slow"), timeout=0.3)
        assert time.monotonic() - start < 1.5
        assert wait_until(lambda: server.stats["cancelled"] == 1)
        # a delay followed by another fault
        start = time.monotonic()
        assert post(server.url, chat("slow"))[0] == 503
        assert 0.15 < time.monotonic() - start < 2.0


def test_drop_malformed_and_no_usage_as_aiohttp_sees_them() -> None:
    plan = FaultPlan(
        {"drop": [Drop()], "partial": [Drop(partial=True)], "bad": [MalformedJSON()]},
        default=[NoUsage()],
    )

    async def scenario(url: str) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for text in ("drop", "partial", "bad", "fine"):
                try:
                    async with session.post(url + "/chat/completions", json=chat(text)) as r:
                        seen[text] = (r.status, await r.json())
                except Exception as exc:  # record what the client observes
                    seen[text] = exc
        return seen

    with FakeOpenAIServer(faults=plan) as server:
        seen = asyncio.run(scenario(server.url))
        assert isinstance(seen["drop"], aiohttp.ClientConnectionError)
        assert isinstance(seen["partial"], aiohttp.ClientPayloadError)
        assert isinstance(seen["bad"], json.JSONDecodeError)
        status, reply = seen["fine"]
        assert status == 200 and "usage" not in reply
        assert reply["choices"][0]["message"]["content"].startswith("Answer to: fine")
        # urllib sees a dropped connection as a connection error too
        server.faults = lambda body, attempt: Drop()
        with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
            post(server.url, chat("drop"), timeout=5)
        stats = server.stats
        assert stats["dropped"] == 3
        assert stats["cancelled"] == 0


def test_attempts_are_counted_per_conversation() -> None:
    calls: list[tuple[str, int]] = []
    plan = FaultPlan({"flaky": [Status(503), Status(500), None, Status(429)]})

    def faults(body: dict[str, Any], attempt: int) -> Any:
        calls.append((body["messages"][-1]["content"], attempt))
        return plan(body, attempt)

    with FakeOpenAIServer(faults=faults) as server:
        codes = [post(server.url, chat("flaky"))[0] for _ in range(5)]
        assert codes == [503, 500, 200, 429, 200]
        post(server.url, chat("other"))
        assert calls[-1] == ("other", 1)
        assert [a for t, a in calls if t == "flaky"] == [1, 2, 3, 4, 5]
        assert server.attempts(chat("flaky")["messages"]) == 5
        assert server.attempts(chat("never")["messages"]) == 0
        # attempts depend on the messages only, not on sampling parameters
        post(server.url, chat("other", temperature=1.0, max_tokens=3))
        assert server.attempts(chat("other")["messages"]) == 2


def test_hashed_faults_pick_a_stable_fraction() -> None:
    faults = hashed_faults(0.3, Status.overloaded(), attempts=2)
    bodies = [chat(f"q{i}") for i in range(1000)]
    hit = [b for b in bodies if faults(b, 1) is not None]
    assert 200 < len(hit) < 400
    assert all(faults(b, 2) is not None and faults(b, 3) is None for b in hit)
    assert hit == [b for b in bodies if faults(b, 1) is not None]


async def _post_many(url: str, bodies: list[dict[str, Any]], timeout: float = 10.0) -> list[Any]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)
    ) as session:

        async def one(body: dict[str, Any]) -> Any:
            async with session.post(url + "/chat/completions", json=body) as response:
                return await response.json()

        return await asyncio.gather(*(one(b) for b in bodies), return_exceptions=True)


def test_capacity_slots_and_speed() -> None:
    with FakeOpenAIServer(slots=2, tokens_per_s=100, tokens_fn=lambda m: 50) as server:
        start = time.monotonic()
        replies = asyncio.run(_post_many(server.url, [chat(f"c{i}") for i in range(4)]))
        elapsed = time.monotonic() - start
        assert all(r["usage"]["completion_tokens"] == 50 for r in replies)
        assert 0.9 < elapsed < 2.0  # two waves of 0.5 s
        stats = server.stats
        assert stats["max_in_service"] == 2
        assert stats["max_queued"] == 2
        assert (stats["completed"], stats["in_service"], stats["queued"]) == (4, 0, 0)
        assert stats["completion_tokens"] == 200


def test_client_disconnect_frees_the_slot_and_counts_cancelled() -> None:
    tokens = {"slow": 50, "fast": 1}  # 5 s vs 0.1 s at 10 tokens/s
    server = FakeOpenAIServer(
        slots=1, tokens_per_s=10, tokens_fn=lambda m: tokens[m[-1]["content"]]
    )

    async def scenario(url: str) -> tuple[Any, Any, float]:
        async def slow() -> Any:
            timeout = aiohttp.ClientTimeout(total=0.4)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                try:
                    async with session.post(url + "/chat/completions", json=chat("slow")) as r:
                        return await r.json()
                except TimeoutError as exc:
                    return exc

        async def fast() -> Any:
            await asyncio.sleep(0.1)  # queue behind the slow request
            return (await _post_many(url, [chat("fast")]))[0]

        start = time.monotonic()
        slow_result, fast_result = await asyncio.gather(slow(), fast())
        return slow_result, fast_result, time.monotonic() - start

    with server:
        slow_result, fast_result, elapsed = asyncio.run(scenario(server.url))
        assert isinstance(slow_result, TimeoutError)
        assert fast_result["usage"]["completion_tokens"] == 1
        assert elapsed < 2.0  # did not wait 5 s for the abandoned request
        assert wait_until(lambda: server.stats["cancelled"] == 1)
        stats = server.stats
        assert (stats["completed"], stats["max_queued"], stats["in_service"]) == (1, 1, 0)


async def _leave_after(url: str, body: dict[str, Any], seconds: float) -> None:
    """Send ``body`` and close the connection after ``seconds`` (unless answered before)."""
    timeout = aiohttp.ClientTimeout(total=seconds)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        with contextlib.suppress(TimeoutError):
            async with session.post(url + "/chat/completions", json=body) as r:
                await r.read()


def _post_root(server: FakeOpenAIServer, path: str, body: Any) -> tuple[int, bytes]:
    request = urllib.request.Request(
        server.url.removesuffix("/v1") + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        return response.status, response.read()


def _metrics_of(server: FakeOpenAIServer) -> str:
    with urllib.request.urlopen(server.url.removesuffix("/v1") + "/metrics", timeout=5) as r:
        return str(r.read().decode())


def _sample(text: str, name: str) -> float:
    [value] = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)]
    return value


def test_the_engine_counts_what_it_decoded_cancelled_work_included() -> None:
    """1 slot at 100 tokens/s: a 100-token request is cut by its client after ~0.3 s (about
    30 decoded), one queued behind it leaves before it starts (nothing decoded)."""
    server = FakeOpenAIServer(slots=1, tokens_per_s=100, tokens_fn=lambda m: 100)

    async def scenario(url: str) -> None:
        await asyncio.gather(_leave_after(url, chat("a"), 0.3), _leave_after(url, chat("b"), 0.2))

    with server:
        asyncio.run(scenario(server.url))
        assert wait_until(lambda: server.stats["cancelled"] == 2)
        stats = server.stats
    assert 15 <= stats["cancelled_decoded_tokens"] <= 45, stats
    assert stats["decoded_tokens"] == stats["cancelled_decoded_tokens"]
    assert stats["cancelled_before_decode"] == 1 and stats["completed"] == 0
    assert (stats["in_service"], stats["queued"], stats["aborted"]) == (0, 0, 0)


def test_finished_requests_count_their_tokens_and_the_prefill_decodes_none() -> None:
    """``base_latency_s`` is the prefill: a client that leaves in it cost no token; the
    finished requests count their n (without tokens_per_s too)."""
    server = FakeOpenAIServer(slots=2, tokens_per_s=100, base_latency_s=0.4, tokens_fn=lambda m: 10)
    with server:
        assert post(server.url, chat("done"))[0] == 200
        asyncio.run(_leave_after(server.url, chat("left"), 0.2))
        assert wait_until(lambda: server.stats["in_service"] == 0)
        stats = server.stats
        server.reset()
        assert server.stats["decoded_tokens"] == server.stats["cancelled_decoded_tokens"] == 0
    assert (stats["decoded_tokens"], stats["completion_tokens"]) == (10, 10)
    assert (stats["cancelled_decoded_tokens"], stats["cancelled_before_decode"]) == (0, 1)
    with FakeOpenAIServer(tokens_fn=lambda m: 7) as instant:
        post(instant.url, chat("x"))
        assert instant.stats["decoded_tokens"] == 7


def test_sglang_aborts_a_request_by_its_rid_queued_or_running() -> None:
    """POST /abort_request {"rid"}: the running request answers at once with finish_reason
    "abort" and what it decoded; the queued one with nothing decoded and usage all 0 (as
    real SGLang, tests/data/sglang/queue/). /v1/loads shows one running and one waiting
    before."""
    server = FakeOpenAIServer(slots=1, tokens_per_s=100, tokens_fn=lambda m: 500)

    async def scenario(url: str) -> tuple[Any, Any, Any, float]:
        root = url.removesuffix("/v1")
        async with aiohttp.ClientSession() as session:

            async def ask(rid: str) -> Any:
                body = chat(rid, rid=rid)
                async with session.post(url + "/chat/completions", json=body) as r:
                    return r.status, await r.json()

            running = asyncio.ensure_future(ask("r1"))
            await asyncio.sleep(0.1)
            queued = asyncio.ensure_future(ask("r2"))
            await asyncio.sleep(0.2)
            async with session.get(root + "/v1/loads?include=core") as r:
                loads = await r.json()
            start = time.monotonic()
            for rid in ("r2", "r1", "unknown"):
                async with session.post(root + "/abort_request", json={"rid": rid}) as r:
                    assert r.status == 200 and await r.read() == b""
            answers = await asyncio.gather(running, queued)
            return loads, answers[0], answers[1], time.monotonic() - start

    with server:
        loads, (s1, running), (s2, queued), elapsed = asyncio.run(scenario(server.url))
        stats = server.stats
    assert loads["loads"][0]["num_running_reqs"] == 1
    assert loads["loads"][0]["num_waiting_reqs"] == 1
    assert elapsed < 1.0  # not the 5 s the running request had left
    assert s1 == s2 == 200
    for reply, rid in ((running, "r1"), (queued, "r2")):
        choice = reply["choices"][0]
        assert (reply["id"], choice["finish_reason"], choice["matched_stop"]) == (
            rid,
            "abort",
            None,
        )
    decoded = running["usage"]["completion_tokens"]
    assert 20 <= decoded <= 60
    assert len(running["choices"][0]["message"]["content"].split()) == decoded
    assert running["usage"]["prompt_tokens"] == 2
    assert queued["usage"] == {**running["usage"], "prompt_tokens": 0, "total_tokens": 0,
                               "completion_tokens": 0}  # fmt: skip
    assert queued["choices"][0]["message"]["content"] == ""
    assert stats["aborted"] == 2 and stats["cancelled_before_decode"] == 1
    assert stats["decoded_tokens"] == stats["cancelled_decoded_tokens"] == decoded
    assert stats["completed"] == 0 and stats["in_service"] == stats["queued"] == 0


def test_aborted_replies_have_the_shapes_real_sglang_sent() -> None:
    """The fake's replies to an abort, running and queued, against tests/data/sglang/queue/
    (recorded by tests/sglang/test_abort.py), token ids asked for."""
    recorded = load_recorded(SGLANG_RECORDED / "queue")
    server = FakeOpenAIServer(
        slots=1, tokens_per_s=100, tokens_fn=lambda m: 500, token_ids_fn=trivial_ids
    )

    async def ask(url: str, rid: str) -> Any:
        async with aiohttp.ClientSession() as session:
            body = chat(rid, rid=rid, return_token_ids=True, max_tokens=900)
            async with session.post(url + "/chat/completions", json=body) as r:
                return await r.json()

    async def scenario(url: str) -> tuple[Any, Any]:
        running = asyncio.ensure_future(ask(url, "abort-running"))
        await asyncio.sleep(0.1)
        queued = asyncio.ensure_future(ask(url, "abort-queued"))
        await asyncio.sleep(0.2)
        for rid in ("abort-queued", "abort-running"):
            await asyncio.to_thread(_post_root, server, "/abort_request", {"rid": rid})
        return await running, await queued

    with server:
        running, queued = asyncio.run(scenario(server.url))
        loads = get_json(server.url.removesuffix("/v1") + "/v1/loads?include=core")
    for name, reply in (("chat_aborted_running", running), ("chat_aborted_queued", queued)):
        real = recorded[name]["response"]
        assert recorded[name]["status"] == 200
        assert json_shape(reply) == json_shape(real), name
        for key in ("finish_reason", "matched_stop"):
            assert reply["choices"][0][key] == real["choices"][0][key], name
        assert reply["id"] == real["id"] == recorded[name]["request"]["rid"]
    assert queued["usage"] == recorded["chat_aborted_queued"]["response"]["usage"]
    assert json_shape(loads) == json_shape(recorded["loads"]["response"])


def test_abort_all_and_an_abort_of_a_request_whose_client_left() -> None:
    """``{"abort_all": true}`` aborts everything; a request whose client left (SGLang
    would notice it at its next check, 10 s here) is still aborted by its rid at once."""
    server = FakeOpenAIServer(
        slots=1, tokens_per_s=100, tokens_fn=lambda m: 1000, disconnect_check_s=10.0
    )
    with server:
        asyncio.run(_leave_after(server.url, chat("x", rid="gone"), 0.2))
        assert server.stats["in_service"] == 1, "still decoding after its client left"
        _post_root(server, "/abort_request", {"rid": "gone"})
        assert wait_until(lambda: server.stats["in_service"] == 0, timeout=1.0)
        stats = server.stats

        async def two(url: str) -> list[Any]:
            return await _post_many(url, [chat("a"), chat("b")])

        async def scenario(url: str) -> list[Any]:
            replies = asyncio.ensure_future(two(url))
            await asyncio.sleep(0.2)
            await asyncio.to_thread(_post_root, server, "/abort_request", {"abort_all": True})
            return await replies

        # Without a rid nothing can be aborted but by abort_all.
        replies = asyncio.run(scenario(server.url))
    assert stats["aborted"] == 1 and 10 <= stats["cancelled_decoded_tokens"] <= 40
    assert [r["choices"][0]["finish_reason"] for r in replies] == ["abort", "abort"]


def test_sglang_notices_a_closed_connection_only_at_its_next_check() -> None:
    """``disconnect_check_s``: the client leaves after 0.3 s, the server decodes on until
    its check at 1 s (about 100 tokens at 100/s), then frees the slot."""
    server = FakeOpenAIServer(
        slots=1, tokens_per_s=100, tokens_fn=lambda m: 1000, disconnect_check_s=1.0
    )
    with server:
        asyncio.run(_leave_after(server.url, chat("x"), 0.3))
        time.sleep(0.3)
        assert server.stats["in_service"] == 1, "still decoding after the client left"
        assert wait_until(lambda: server.stats["in_service"] == 0, timeout=2.0)
        stats = server.stats
    assert 80 <= stats["cancelled_decoded_tokens"] <= 110, stats
    assert stats["decoded_tokens"] == stats["cancelled_decoded_tokens"]
    assert (stats["cancelled"], stats["cancelled_before_decode"], stats["aborted"]) == (1, 0, 0)


def test_a_queued_request_whose_client_left_keeps_its_place_until_the_check() -> None:
    """1 slot, check every 1 s: B's client leaves at 0.2 s while B waits behind A (0.4 s
    of work); B keeps its place ahead of C (queued at 0.1 s), gets the slot at 0.4 s and
    decodes until its check at ~1.05 s; only then C starts. A request that would finish
    before its check finishes (all its tokens wasted); one still queued at its check leaves
    with none."""

    def tokens(messages: list[dict[str, Any]]) -> int:
        return {"a": 40, "b": 1000, "c": 10, "d": 5}[messages[-1]["content"]]

    server = FakeOpenAIServer(slots=1, tokens_per_s=100, tokens_fn=tokens, disconnect_check_s=1.0)

    async def scenario(url: str) -> list[Any]:
        a = asyncio.ensure_future(_post_many(url, [chat("a")]))
        await asyncio.sleep(0.05)
        b = asyncio.ensure_future(_leave_after(url, chat("b"), 0.15))
        await asyncio.sleep(0.05)
        c = asyncio.ensure_future(_post_many(url, [chat("c")]))
        await b
        return [await a, await c]

    with server:
        started = time.monotonic()
        (a,), (c,) = asyncio.run(scenario(server.url))
        c_done = time.monotonic() - started
        stats = server.stats
    assert a["usage"]["completion_tokens"] == 40 and c["usage"]["completion_tokens"] == 10
    assert 1.0 <= c_done <= 1.6, (
        c_done,
        str(stats),
    )  # after B's check at ~1.05 s, not after A at 0.4 s
    b = stats["cancelled_decoded_tokens"]
    assert 50 <= b <= 75, stats  # B from 0.4 s to its check
    assert stats["decoded_tokens"] == 40 + b + 10
    assert stats["cancelled_before_decode"] == 0 and stats["completed"] == 2

    # A short request whose client left decodes to its end; one still queued at its
    # check leaves the queue without a token.
    server = FakeOpenAIServer(slots=1, tokens_per_s=10, tokens_fn=tokens, disconnect_check_s=1.0)

    async def short(url: str) -> None:
        hold = asyncio.ensure_future(_post_many(url, [chat("c")]))  # 1 s of work
        await asyncio.sleep(0.05)
        await _leave_after(url, chat("b"), 0.1)  # queued, its check at ~1.05 s
        await hold

    with server:
        asyncio.run(_leave_after(server.url, chat("d"), 0.1))  # 5 tokens, 0.5 s
        assert wait_until(lambda: server.stats["in_service"] == 0)
        assert server.stats["cancelled_decoded_tokens"] == 5
        server.reset()
        asyncio.run(short(server.url))
        assert wait_until(lambda: server.stats["queued"] == server.stats["in_service"] == 0)
        stats = server.stats
    assert stats["decoded_tokens"] == 10 and stats["cancelled_before_decode"] == 1


def _series(text: str) -> dict[str, tuple[str, str, frozenset[str]]]:
    """name -> (help, type, label names) of a Prometheus text answer."""
    helps, types, labels = {}, {}, {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, rest = line[7:].partition(" ")
            helps[name] = rest
        elif line.startswith("# TYPE "):
            name, _, rest = line[7:].partition(" ")
            types[name] = rest
        elif line and not line.startswith("#"):
            name, _, rest = line.partition("{")
            labels[name] = frozenset(p.split("=")[0] for p in rest.split("}")[0].split(","))
    return {name: (helps[name], types[name], labels[name]) for name in labels}


GAUGES = {
    "sglang": (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:generation_tokens_total",
    ),
    "vllm": (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:generation_tokens_total",
    ),
}


@pytest.mark.parametrize("dialect", ["sglang", "vllm"])
def test_metrics_have_the_real_names_help_and_labels(dialect: str) -> None:
    """/metrics against tests/data/<dialect>/metrics.txt (recorded by
    tests/sglang/test_abort.py and tests/vllm/test_vllm_abort.py): the running and waiting
    gauges and the generated-token counter."""
    recorded = _series((RECORDED[dialect] / "metrics.txt").read_text(encoding="utf-8"))
    with FakeOpenAIServer(dialect=dialect) as server:
        fake = _series(_metrics_of(server))
    assert set(fake) == set(GAUGES[dialect])
    for name in GAUGES[dialect]:
        assert fake[name] == recorded[name], name


@pytest.mark.parametrize("dialect", ["sglang", "vllm"])
def test_metrics_follow_the_queue_and_the_tokens(dialect: str) -> None:
    """1 slot at 100 tokens/s, 1000-token requests: one running, one waiting. vLLM's token
    counter moves while a request decodes, SGLang's when it leaves (as the real ones)."""
    running, waiting, generated = GAUGES[dialect]
    server = FakeOpenAIServer(dialect=dialect, slots=1, tokens_per_s=100, tokens_fn=lambda m: 1000)

    async def scenario(url: str) -> None:
        await asyncio.gather(_leave_after(url, chat("a"), 0.6), _leave_after(url, chat("b"), 0.6))

    with server:
        thread = threading.Thread(target=asyncio.run, args=(scenario(server.url),))
        thread.start()
        time.sleep(0.4)
        busy = _metrics_of(server)
        thread.join()
        assert wait_until(lambda: server.stats["in_service"] == server.stats["queued"] == 0)
        done = _metrics_of(server)
        decoded = server.stats["decoded_tokens"]
    assert (_sample(busy, running), _sample(busy, waiting)) == (1.0, 1.0)
    if dialect == "vllm":
        assert 20 <= _sample(busy, generated) <= 50
    else:
        assert _sample(busy, generated) == 0.0
    assert (_sample(done, running), _sample(done, waiting)) == (0.0, 0.0)
    assert _sample(done, generated) == decoded and 40 <= decoded <= 80


def test_the_command_line_takes_the_disconnect_check() -> None:
    args = build_parser().parse_args(["--disconnect-check-s", "4"])
    assert args.disconnect_check_s == 4.0
    assert build_parser().parse_args([]).disconnect_check_s == 0.0


def _read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            raise TimeoutError("no line from the fake server")
    return proc.stdout.readline()


def test_subprocess_mode_serves_many_connections_and_stops_on_sigterm() -> None:
    cmd = [sys.executable, str(FAKE), "--port", "0", "--slots", "2000", "--tokens-per-s", "20"]
    cmd += ["--mean-tokens", "10", "--token-spread", "0", "--model", "m"]
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ)
    ) as proc:
        try:
            line = _read_line(proc, timeout=15)
            assert line.startswith("READY http://127.0.0.1:")
            url = line.split()[1]
            assert url.endswith("/v1")
            assert get_json(url + "/models")["data"][0]["id"] == "m"

            _raise_own_fd_limit(2500)
            n = 1000  # all held open at once: each request takes 0.5 s
            replies = asyncio.run(_post_many(url, [chat(f"p{i}") for i in range(n)], timeout=20))
            errors = [r for r in replies if isinstance(r, BaseException)]
            assert not errors, errors[:3]
            stats = get_json(url.removesuffix("/v1") + "/stats")
            assert stats["completed"] == n
            assert stats["max_in_service"] > n // 2

            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0
            assert proc.stderr is not None
            assert '"completed": 1000' in proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


def test_subprocess_mode_speaks_the_dialect_it_is_given() -> None:
    cmd = [sys.executable, str(FAKE), "--port", "0", "--dialect", "vllm", "--reasoning"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            url = _read_line(proc, timeout=15).split()[1]
            assert "permission" in get_json(url + "/models")["data"][0]
            message = json.loads(post(url, chat("hi", max_tokens=2))[2])["choices"][0]["message"]
            assert message["reasoning"] and "reasoning_content" not in message
            status, _, raw = post(url, {"messages": "hi"})
            assert status == 400 and json.loads(raw)["error"]["param"] == "body.messages"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


def _raise_own_fd_limit(wanted: int) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        if hard != resource.RLIM_INFINITY and hard < wanted:
            pytest.skip(f"open-file limit {hard} too low for 1000 connections")
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


# --------------------------------------------------------------------------- the real shapes

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
RECORDED = {"sglang": SGLANG_RECORDED, "vllm": VLLM_RECORDED}
# Recordings the fake has no counterpart of: stop strings (the fake has none), and a
# history with reasoning (the fake's answers do not depend on it).
NOT_FAKED = {
    "sglang": {"chat_stop_string", "chat_history"},
    "vllm": {"chat_stop_string", "chat_token_ids_stop_string", "chat_history"},
}


def trivial_ids(body: dict[str, Any], message: dict[str, Any]) -> tuple[list[int], list[int]]:
    """A token_ids_fn: a prompt id per message, a completion id per word."""
    words = (message.get("reasoning_content") or "").split() + message["content"].split()
    return list(range(len(body["messages"]))), [7] * len(words)


def fake_counterparts(dialect: str) -> dict[str, tuple[int, Any]]:
    """name -> (status, body) of the fake's answer to each recorded situation."""
    long_prompt = " ".join(["capital"] * 40)
    ids = {"return_token_ids": True}
    answers: dict[str, tuple[int, Any]] = {}
    options: dict[str, Any] = {"dialect": dialect, "token_ids_fn": trivial_ids}
    thinking = {"reasoning": True, "reasoning_tokens": 8, "tokens_fn": lambda m: 20}
    with FakeOpenAIServer(**thinking, **options) as server:
        answers["chat_thinking"] = reply_of(post(server.url, chat("Why?", max_tokens=8)))
        answers["chat_token_ids"] = reply_of(post(server.url, chat("Why?", max_tokens=8, **ids)))
    plain = {"tokens_fn": lambda m: 20, "call_tools": True, "max_model_len": 32}
    with FakeOpenAIServer(**plain, **options) as server:
        answers["models"] = (200, get_json(server.url + "/models"))
        answers["chat_no_thinking"] = reply_of(post(server.url, chat("Why?", max_tokens=8)))
        answers["chat_stop_eos"] = reply_of(post(server.url, chat("Why?", max_tokens=30)))
        called = chat("Weather?", max_tokens=30, tools=[WEATHER], tool_choice="required")
        answers["chat_tool_call"] = reply_of(post(server.url, called))
        answers["error_context_too_long"] = reply_of(post(server.url, chat(long_prompt)))
        malformed = {"model": "fake-model", "messages": "hi", "max_tokens": 4}
        answers["error_malformed"] = reply_of(post(server.url, malformed))
        if dialect == "vllm":
            eos = chat("Why?", max_tokens=30, **ids)
            answers["chat_token_ids_eos"] = reply_of(post(server.url, eos))
            length = chat("Why?", max_tokens=8, **ids)
            answers["chat_token_ids_length"] = reply_of(post(server.url, length))
        else:
            too_many = chat("Why?", max_tokens=31)  # 2 prompt tokens + 31 > 32
            answers["error_context_with_max_tokens"] = reply_of(post(server.url, too_many))
    if dialect == "vllm":  # thinking, as recorded: all of what is left is reasoning
        more = {**thinking, "reasoning_tokens": 64, "max_model_len": 32}
        with FakeOpenAIServer(**more, **options) as server:
            # 16 prompt tokens + 20 > 32: max_tokens clamped to 16, cut there.
            clamped = chat(" ".join(["capital"] * 15), max_tokens=20)
            answers["error_context_with_max_tokens"] = reply_of(post(server.url, clamped))
    return answers


def reply_of(answer: tuple[int, dict[str, str], bytes]) -> tuple[int, Any]:
    return answer[0], json.loads(answer[2])


@pytest.mark.parametrize("dialect", ["sglang", "vllm"])
def test_the_fake_answers_in_the_shapes_the_real_server_sent(dialect: str) -> None:
    """Keys, types and nesting of every answer equal what the real server sent in the same
    situation (tests/data/sglang/ and tests/data/vllm/, recorded by tests/sglang/ and
    tests/vllm/ test_generate_server.py), and so do the status and finish reason."""
    recorded = load_recorded(RECORDED[dialect])
    fake = fake_counterparts(dialect)
    assert recorded.keys() == fake.keys() | NOT_FAKED[dialect]
    for name, (status, body) in fake.items():
        assert status == recorded[name]["status"], name
        assert json_shape(body) == json_shape(recorded[name]["response"]), name
        if "choices" in recorded[name]["response"]:
            real = recorded[name]["response"]["choices"][0]
            assert body["choices"][0]["finish_reason"] == real["finish_reason"], name


@pytest.mark.parametrize("dialect", ["sglang", "vllm"])
def test_token_ids_come_from_the_hook_in_the_dialects_places(dialect: str) -> None:
    seen: list[tuple[dict[str, Any], dict[str, Any]]] = []

    def hook(body: dict[str, Any], message: dict[str, Any]) -> tuple[list[int], list[int]]:
        seen.append((body, message))
        return [1, 2, 3], [4, 5]

    def ids_of(reply: dict[str, Any]) -> tuple[Any, Any]:
        choice = reply["choices"][0]
        if dialect == "vllm":
            return reply["prompt_token_ids"], choice["token_ids"]
        return choice.get("prompt_token_ids"), choice.get("response_token_ids")

    ask = chat("Why?", max_tokens=3, return_token_ids=True)
    with FakeOpenAIServer(dialect=dialect, reasoning=True, reasoning_tokens=2) as server:
        assert ids_of(json.loads(post(server.url, ask)[2])) == (None, None)  # no hook
    with FakeOpenAIServer(
        dialect=dialect, reasoning=True, reasoning_tokens=2, token_ids_fn=hook
    ) as server:
        reply = json.loads(post(server.url, ask)[2])
        assert ids_of(reply) == ([1, 2, 3], [4, 5])
        if dialect == "vllm":
            assert "prompt_token_ids" not in reply["choices"][0]
        else:
            assert "prompt_token_ids" not in reply and "token_ids" not in reply["choices"][0]
        [(body, message)] = seen
        assert body == ask  # the request, and the answer as the engine keeps it
        assert message == {
            "role": "assistant",
            "content": "Answer",
            "reasoning_content": "Thinking about:",
        }
        unasked = json.loads(post(server.url, chat("Why?", max_tokens=3))[2])
        assert ids_of(unasked) == (None, None) and len(seen) == 1  # the flag, not the hook
        if dialect == "sglang":  # no keys at all; vLLM's are there, null
            assert not {"prompt_token_ids", "response_token_ids"} & unasked["choices"][0].keys()
        server.token_ids_fn = lambda body, message: None
        assert ids_of(json.loads(post(server.url, ask)[2])) == (None, None)


def test_the_hook_gets_tool_calls_in_the_wire_form() -> None:
    seen: list[dict[str, Any]] = []

    def hook(body: dict[str, Any], message: dict[str, Any]) -> None:
        seen.append(message)

    for dialect in ("sglang", "vllm"):
        with FakeOpenAIServer(dialect=dialect, call_tools=True, token_ids_fn=hook) as server:
            post(server.url, chat("Paris", tools=[WEATHER], return_token_ids=True))
    for message in seen:
        [call] = message["tool_calls"]
        assert call.keys() == {"id", "type", "function"} and message["content"] == ""
    assert seen[0]["tool_calls"][0]["id"].startswith("call_")
    assert seen[1]["tool_calls"][0]["id"].startswith("chatcmpl-tool-")


def test_vllm_dialect_messages_errors_and_clamping() -> None:
    options: dict[str, Any] = {"dialect": "vllm", "max_model_len": 20, "tokens_fn": lambda m: 50}
    with FakeOpenAIServer(reasoning=True, reasoning_tokens=4, strict_model=True, **options) as s:
        reply = json.loads(post(s.url, chat("one two three", max_tokens=3))[2])
        message = reply["choices"][0]["message"]
        assert "reasoning_content" not in message
        assert (message["content"], message["reasoning"]) == (None, "Thinking about: one")
        assert reply["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}
        assert "reasoning_tokens" not in reply["usage"]
        clamped = json.loads(post(s.url, chat("one two three", max_tokens=30))[2])
        assert clamped["usage"]["completion_tokens"] == 20 - 4  # what is left: no 400
        assert clamped["choices"][0]["finish_reason"] == "length"
        assert clamped["choices"][0]["stop_reason"] is None

        status, _, raw = post(s.url, chat(" ".join(["w"] * 30)))
        assert (status, json.loads(raw)) == (
            400,
            {
                "error": {
                    "message": "This model's maximum context length is 20 tokens. However, "
                    "your prompt contains at least 21 input tokens, which exceeds this limit "
                    "even without any output tokens. Please reduce the length of the input "
                    "prompt. (parameter=input_tokens, value=21)",
                    "type": "BadRequestError",
                    "param": "input_tokens",
                    "code": 400,
                }
            },
        )
        status, _, raw = post(s.url, chat("hi", max_tokens=0))
        assert status == 400 and json.loads(raw)["error"]["param"] == "max_tokens"
        status, _, raw = post(s.url, {**chat("hi"), "model": "other"})
        assert (status, json.loads(raw)["error"]) == (
            404,
            {
                "message": "The model `other` does not exist. Valid aliases: fake-model.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
            },
        )
    with pytest.raises(ValueError, match="clamps"):
        Status.context_length_exceeded(10, 12, 5, dialect="vllm")
    plan = FaultPlan({"a": [Status.server_error()], "b": [Status.overloaded()]})
    with FakeOpenAIServer(dialect="vllm", faults=plan) as server:
        errors = {t: json.loads(post(server.url, chat(t))[2])["error"] for t in "ab"}
    assert (errors["a"]["type"], errors["a"]["param"]) == ("InternalServerError", None)
    assert errors["b"]["type"] == "Service Unavailable"


def test_tool_calls_as_sglang_returns_them() -> None:
    with FakeOpenAIServer(call_tools=True, tokens_fn=lambda m: 12) as server:
        reply = json.loads(post(server.url, chat("Paris", tools=[WEATHER]))[2])
        choice = reply["choices"][0]
        [call] = choice["message"]["tool_calls"]
        assert (choice["finish_reason"], choice["matched_stop"]) == ("tool_calls", None)
        assert choice["message"]["content"] == ""
        assert call["id"].startswith("call_") and len(call["id"]) == 29
        assert (call["index"], call["type"], call["function"]["name"]) == (
            0,
            "function",
            "get_weather",
        )
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        # No tools, tool_choice "none", or after the tool's result: an answer.
        for body in (
            chat("Paris"),
            chat("Paris", tools=[WEATHER], tool_choice="none"),
            {
                "messages": [
                    {"role": "user", "content": "Paris"},
                    choice["message"],
                    {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
                ],
                "tools": [WEATHER],
            },
        ):
            answer = json.loads(post(server.url, body)[2])["choices"][0]
            assert answer["finish_reason"] == "stop" and "tool_calls" not in answer["message"]
        # A call cut by max_tokens is dropped, as SGLang's parser drops it.
        cut = json.loads(post(server.url, chat("Paris", tools=[WEATHER], max_tokens=3))[2])
        assert cut["choices"][0]["finish_reason"] == "length"
        assert cut["choices"][0]["message"] == {
            "role": "assistant",
            "content": "",
            "reasoning_content": None,
        }


def test_tool_results_must_answer_the_calls_before_them() -> None:
    def history(*results: dict[str, Any], calls: tuple[str, ...] = ("c1",)) -> dict[str, Any]:
        function = {"name": "get_weather", "arguments": "{}"}
        turn = {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": c, "type": "function", "function": function} for c in calls],
        }
        return {"messages": [{"role": "user", "content": "q"}, turn, *results]}

    def result(cid: str | None) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": cid, "content": "r"}

    cases = {
        "tool_call_id 'x' does not match an unanswered tool call.": history(result("x")),
        "Tool calls ['c2'] have no tool message answering them.": history(
            result("c1"), calls=("c1", "c2")
        ),
        "A tool message must follow an assistant message with tool_calls.": {
            "messages": [{"role": "user", "content": "q"}, result("c1")]
        },
    }
    with FakeOpenAIServer(check_tool_pairing=True) as server:
        for message, body in cases.items():
            status, _, raw = post(server.url, body)
            assert (status, json.loads(raw)["message"]) == (400, message)
        assert post(server.url, history(result("c1")))[0] == 200
    with FakeOpenAIServer() as server:  # off by default, as SGLang for most models
        assert post(server.url, history(result("x")))[0] == 200


def test_openai_style_error_bodies() -> None:
    plan = FaultPlan({"a": [Status.context_length_exceeded(10, 12)]})
    with FakeOpenAIServer(faults=plan, error_style="openai") as server:
        status, _, raw = post(server.url, chat("a"))
    assert status == 400
    assert json.loads(raw) == {
        "error": {
            "message": "The input (12 tokens) is longer than the model's context length "
            "(10 tokens).",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }


@pytest.mark.parametrize("dialect", ["sglang", "vllm"])
def test_refused_fields_get_openais_unknown_argument_answer(dialect: str) -> None:
    with FakeOpenAIServer(dialect=dialect, refuse_fields=["return_token_ids"]) as server:
        status, _, raw = post(server.url, chat("hi", return_token_ids=True))
        plain_status, _, _ = post(server.url, chat("hi"))
    body = json.loads(raw)
    error = body["error"] if dialect == "vllm" else body
    assert status == 400 and plain_status == 200
    assert error["message"] == "Unrecognized request argument supplied: return_token_ids"
    assert error["type"] == "invalid_request_error"
