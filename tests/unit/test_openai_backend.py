"""The HTTP backend against a fault-injecting OpenAI-compatible server.

Every prompt must end either in the output or in the errors list: none
silently lost, none duplicated, whatever the server does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from support.fake_openai import (
    Delay,
    Drop,
    FakeOpenAIServer,
    FaultPlan,
    MalformedJSON,
    NoUsage,
    Status,
    hashed_faults,
)
from support.fakes import make_prompt

from eagle3data.generation import streaming
from eagle3data.generation.driver import (
    ErrorLimits,
    GenerationAborted,
    GenerationJob,
    Prompt,
    run_generation,
)
from eagle3data.generation.engines.openai_engine import (
    EngineUnavailable,
    HttpSettings,
    OpenAIEngine,
)
from eagle3data.prompts.sources import prompt_hash

SAMPLING = {
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": -1,
    "max_tokens": 64,
    "repetition_penalty": 1.0,
    "stop": [],
}


def prompts(n: int) -> list:
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": f"question {i}"}]
        if i % 4 == 0:
            messages += [
                {"role": "assistant", "content": "source answer"},
                {"role": "user", "content": f"follow-up {i}"},
            ]
        out.append(make_prompt(f"p{i:03d}", messages))
    return out


def job(tmp_path: Path, n: int = 24, **kw) -> GenerationJob:
    return GenerationJob(
        dataset="A1",
        prompts=prompts(n),
        journal=tmp_path / "journal.jsonl",
        model="fake-model",
        sampling=SAMPLING,
        progress_interval_s=0,
        **kw,
    )


def engine_for(*urls: str, **kw) -> OpenAIEngine:
    settings = dict(
        model="fake-model",
        concurrency=8,
        request_timeout_s=5,
        max_retries=4,
        backoff_initial_s=0.01,
        backoff_max_s=0.05,
        endpoint_pause_s=0.2,
    )
    settings.update(kw)
    return OpenAIEngine(
        HttpSettings(endpoints=list(urls), **settings),
        sampling=SAMPLING,
        seed=0,
        count_tokens=lambda text: len(text.split()),
    )


def generate(j: GenerationJob, *urls: str, limits: ErrorLimits | None = None, **kw):
    return run_generation(j, lambda: engine_for(*urls, **kw), streaming=True, error_limits=limits)


def outcomes(j: GenerationJob) -> list[dict]:
    """The journal's outcome records (ok or failed): abandoned ones only note waste."""
    records = [json.loads(line) for line in j.journal.read_text().splitlines()]
    return [r for r in records if r["status"] != "abandoned"]


def accounted(result, j: GenerationJob) -> None:
    """Every prompt is in exactly one place; the journal holds no id twice."""
    ids = [p.id for p in j.prompts]
    out = [r["id"] for r in result.rows]
    failed = [f["id"] for f in result.failures]
    beyond = ids[result.stats["prompts"] - result.stats["beyond_limits"] :]
    assert sorted(out + failed + beyond) == sorted(ids)
    journal = [r["id"] for r in outcomes(j)]
    assert len(journal) == len(set(journal))


def test_generates_every_turn_on_the_regenerated_history(tmp_path: Path) -> None:
    with FakeOpenAIServer() as server:
        j = job(tmp_path)
        result = generate(j, server.url)
    assert [r["id"] for r in result.rows] == [p.id for p in j.prompts]
    accounted(result, j)
    multi = result.rows[0]
    assert [m["role"] for m in multi["messages"]] == ["user", "assistant", "user", "assistant"]
    assert multi["messages"][1]["content"].startswith("Answer to: question 0")
    # The second request carried the regenerated answer, not the source one.
    second = [b for b in server.requests if b["messages"][-1]["content"] == "follow-up 0"]
    assert second[0]["messages"][1]["content"] == multi["messages"][1]["content"]
    assert multi["usage"]["completion_tokens"] == sum(
        t["completion_tokens"] for t in multi["turns"]
    )
    assert all(b["max_tokens"] == 64 and b["temperature"] == 0.0 for b in server.requests)


@pytest.mark.parametrize(
    "fault",
    [
        Status(500),
        Status(503),
        Status(429, retry_after=0),
        Status(408),
        Drop(),
        Drop(partial=True),
        MalformedJSON(),
        Status(502, raw_body="<html>bad gateway</html>"),
    ],
    ids=["500", "503", "429", "408", "drop", "partial", "malformed", "html-502"],
)
def test_transient_faults_are_retried_to_the_same_output(tmp_path: Path, fault) -> None:
    with FakeOpenAIServer() as clean:
        reference = generate(job(tmp_path / "ref"), clean.url)
    with FakeOpenAIServer(faults=hashed_faults(0.5, fault, attempts=2)) as server:
        j = job(tmp_path / "faulty")
        result = generate(j, server.url)
        assert server.stats["faulted"] > 0
    assert result.rows == reference.rows
    assert result.stats["failed"] == 0
    accounted(result, j)


def test_timeouts_are_retried(tmp_path: Path) -> None:
    with FakeOpenAIServer(faults=hashed_faults(0.3, Delay(3.0))) as server:
        j = job(tmp_path, n=8)
        result = generate(j, server.url, request_timeout_s=0.5)
        assert server.stats["cancelled"] > 0
    assert len(result.rows) == 8
    accounted(result, j)


def test_client_errors_are_recorded_and_skipped_not_retried(tmp_path: Path) -> None:
    plan = FaultPlan({"question 3": [Status.context_length_exceeded()] * 10})
    with FakeOpenAIServer(faults=plan) as server:
        j = job(tmp_path, n=8)
        result = generate(j, server.url)
        attempts = server.attempts([{"role": "user", "content": "question 3"}])
    assert attempts == 1, "a 400 is not retried"
    assert [f["id"] for f in result.failures] == ["p003"]
    assert "context" in result.failures[0]["error"] and "HTTP 400" in result.failures[0]["error"]
    assert "p003" not in [r["id"] for r in result.rows] and len(result.rows) == 7
    accounted(result, j)
    # A re-run does not ask again about the recorded failure.
    with FakeOpenAIServer() as server:
        again = generate(j, server.url)
        assert server.requests == []
    assert again.rows == result.rows


def test_missing_usage_is_counted_with_the_tokenizer_and_recorded(tmp_path: Path) -> None:
    with FakeOpenAIServer(faults=FaultPlan({"question 1": [NoUsage()]})) as server:
        result = generate(job(tmp_path, n=4), server.url)
    row = next(r for r in result.rows if r["id"] == "p001")
    assert row["turns"][0]["usage_source"] == "tokenizer"
    assert row["usage"]["completion_tokens"] == len(row["messages"][-1]["content"].split())
    assert all("usage_source" not in r["turns"][0] for r in result.rows if r["id"] != "p001")


def test_budget_is_never_exceeded_and_in_flight_work_is_cancelled(tmp_path: Path) -> None:
    with FakeOpenAIServer(slots=16, tokens_per_s=400, mean_tokens=40) as server:
        j = job(tmp_path, n=200, token_budget=1200)
        result = generate(j, server.url, concurrency=32)
        time.sleep(0.2)
        stats = server.stats
    used = sum(r["usage"]["completion_tokens"] for r in result.rows)
    assert used <= 1200 and result.stats["stop_reason"] == "token_budget"
    assert used + 64 > 1200, "the prefix is the longest that fits"
    assert stats["received"] < 200, "dispatch stopped near the budget"
    # SGLang (the fake's dialect) aborts each cancelled request by its rid and says what it
    # had decoded: what we count as generated is exactly what the engine decoded.
    # (A conversation cancelled before its request went out is abandoned with nothing
    # decoded and never reaches the server.)
    assert 0 < stats["aborted"] <= result.stats["abandoned_requests"]
    assert result.stats["generated_tokens_total"] == stats["decoded_tokens"]
    assert result.stats["waste_tokens"] == stats["decoded_tokens"] - used
    assert result.stats["abandoned_tokens_estimated"] == 0
    accounted(result, j)


def test_the_queue_gauge_is_read_near_the_end_only_and_at_its_cost_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reading that takes ``t`` s is followed by the next one no sooner than
    ``GAUGE_COST_SHARE * t`` later (here 20 x 20 ms: 0.4 s, four times the 0.1 s floor), and
    none is taken before the end of the budget is near: the gauge costs the server a bounded
    share of its time."""
    monkeypatch.setattr(streaming, "GAUGE_COST_SHARE", 20)
    readings: list[tuple[float, float, int]] = []  # (start, end, tokens kept so far)
    original = OpenAIEngine.server_queues

    async def slow_reading(self: OpenAIEngine) -> Any:
        start = time.monotonic()
        await asyncio.sleep(0.02)
        queues = await original(self)
        readings.append((start, time.monotonic(), len(outcomes(j)) if j.journal.exists() else 0))
        return queues

    monkeypatch.setattr(OpenAIEngine, "server_queues", slow_reading)
    with FakeOpenAIServer(slots=2, tokens_per_s=400, mean_tokens=24) as server:
        j = job(tmp_path, n=200, token_budget=2400)
        result = generate(j, server.url, concurrency=12)
    assert result.stats["stop_reason"] == "token_budget"
    assert len(readings) >= 2, readings
    for (start, end, _), (next_start, _, _) in itertools.pairwise(readings):
        assert next_start - start >= 20 * (end - start) * 0.95, readings
    # Near the end only: the first reading comes after most of the budget was kept.
    assert readings[0][2] >= len(outcomes(j)) // 2, (readings[0], len(outcomes(j)))


def test_a_request_waiting_in_the_servers_queue_is_cancelled_before_it_decodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twelve single-turn conversations in flight on 2 slots: near the end of the budget the
    requests still waiting in the server's queue (its /v1/loads gauge) that the prefix will
    not need are aborted before they decode a token; what the cancelled ones had decoded is
    in the waste."""

    # Answers of 8 or 64 tokens (one in three long): until the long ones near the end are
    # known, the plan wants more than the slots run; once they are, it no longer needs the
    # last of those waiting. 80-640 ms an answer (slow enough that a loaded machine still
    # polls the queue, every 0.1 s, many times in the tail: CI once caught none at 400 tok/s).
    def tokens(messages: list[dict]) -> int:
        return 64 if int(prompt_hash(messages), 16) % 3 == 0 else 8

    # Every 0.1 s whatever a reading took: on a loaded machine (the suite's other worker)
    # a slow reading would otherwise space the polls past the whole tail (the cost rule,
    # tested on its own in test_dispatch_tail.py).
    monkeypatch.setattr(streaming, "GAUGE_COST_SHARE", 0)
    with FakeOpenAIServer(slots=2, tokens_per_s=100, tokens_fn=tokens) as server:
        single = [
            make_prompt(f"s{i:03d}", [{"role": "user", "content": f"q {i}"}]) for i in range(80)
        ]
        j = dataclasses.replace(job(tmp_path, token_budget=1000), prompts=single)
        result = generate(j, server.url, concurrency=12)
        time.sleep(0.2)
        stats = server.stats
    assert result.stats["stop_reason"] == "token_budget"
    assert stats["cancelled_before_decode"] > 0, stats
    abandoned = [
        json.loads(line) for line in j.journal.read_text().splitlines() if "abandoned" in line
    ]
    nothing = [r for r in abandoned if r["completion_tokens_spent"] == 0]
    assert len(nothing) >= stats["cancelled_before_decode"] > 0
    assert all(r["spent_source"] == "server" for r in abandoned)
    assert result.stats["generated_tokens_total"] == stats["decoded_tokens"]
    # Each one sent was aborted (the rest were cancelled before they went out).
    assert result.stats["abandoned_requests"] == len(abandoned) >= stats["aborted"] > 0
    # An abandoned record decides nothing: a prompt given back while waiting may be sent
    # again later, and its outcome then comes after it in the journal.
    lines = [json.loads(line) for line in j.journal.read_text().splitlines()]
    first_outcome = {}
    for n, r in reversed(list(enumerate(lines))):
        if r["status"] != "abandoned":
            first_outcome[r["id"]] = n
    for n, r in enumerate(lines):
        if r["status"] == "abandoned" and r["id"] in first_outcome:
            assert first_outcome[r["id"]] > n
    accounted(result, j)


def test_a_server_without_aborts_gets_its_cancelled_decode_estimated(tmp_path: Path) -> None:
    """vLLM frees a request when its connection closes and says nothing about it: what a
    cancelled request had decoded is estimated, and marked so."""
    # As many slots as requests: every request sent decodes at once, so the token clock
    # has run for the ones cancelled. (With a queue, a request cancelled before any sent
    # after it finished has only the ordering floor, 0: seen on a loaded CI machine.)
    with FakeOpenAIServer(slots=32, tokens_per_s=400, mean_tokens=40, dialect="vllm") as server:
        j = job(tmp_path, n=200, token_budget=1200)
        result = generate(j, server.url, concurrency=32)
        time.sleep(0.2)
        stats = server.stats
    # Every request the server cancelled is an abandoned record. Those not written yet when
    # they were cancelled (waiting for their turn, openai_engine._InOrder) decoded nothing
    # and say so. One cancelled while its body was on the wire (written, aiohttp's write
    # callback not yet run) is one of those too, yet reaches the server, which then cancels
    # it as it arrives (seen on CI's loaded machine: 13 cancelled, 12 estimated): so the
    # server's count is bounded by all the records, not by the estimated ones.
    abandoned = [
        json.loads(line) for line in j.journal.read_text().splitlines() if "abandoned" in line
    ]
    not_written = [r for r in abandoned if r["spent_source"] != "estimate"]
    assert stats["aborted"] == 0 and 0 < stats["cancelled"] <= len(abandoned)
    assert len(abandoned) == result.stats["abandoned_requests"]
    assert len(abandoned) > len(not_written)  # some went out and decoded: estimated
    assert all(r["completion_tokens_spent"] == 0 for r in not_written)
    assert result.stats["abandoned_tokens_estimated"] > 0
    # The estimate stands in for what the server decoded (it counted it; we could not).
    counted = result.stats["generated_tokens_total"] - result.stats["abandoned_tokens_estimated"]
    assert counted <= stats["decoded_tokens"]
    accounted(result, j)


def test_resume_counts_the_journal_and_asks_nothing_twice(tmp_path: Path) -> None:
    j = job(tmp_path, n=40, token_budget=900)
    with FakeOpenAIServer() as clean:
        reference = generate(job(tmp_path / "ref", n=40, token_budget=900), clean.url)
    # First run dies: every request fails after the 10th conversation.
    seen: set[str] = set()

    def dies_after_ten(body, attempt):
        key = body["messages"][0]["content"]
        seen.add(key)
        return Status(500) if len(seen) > 10 else None

    with (
        FakeOpenAIServer(faults=dies_after_ten) as server,
        pytest.raises(GenerationAborted, match="consecutive failures"),
    ):
        generate(j, server.url, max_retries=0, limits=ErrorLimits(max_consecutive_failures=5))
    kept = [r["id"] for r in outcomes(j)]
    assert kept, "finished conversations were journaled"
    with FakeOpenAIServer() as server:
        result = generate(j, server.url)
        asked = {p.id for p in j.prompts if server.attempts(p.messages[:1]) > 0}
    assert not asked & set(kept), "nothing journaled is asked again"
    assert result.stats["records_resumed"] == len(kept)
    assert result.rows == reference.rows
    accounted(result, j)


def test_error_rate_limit_stops_the_run(tmp_path: Path) -> None:
    # A permanent 400 that is not about the context (those say nothing about the server).
    plan = hashed_faults(0.8, Status(400, "Invalid request: stop must be a list"), attempts=100)
    with (
        FakeOpenAIServer(faults=plan) as server,
        pytest.raises(GenerationAborted, match="attempts failed"),
    ):
        generate(
            job(tmp_path, n=60),
            server.url,
            limits=ErrorLimits(max_consecutive_failures=100, max_error_rate=0.5),
        )


def test_unreachable_endpoint_fails_fast_naming_the_url(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket closes
    url = f"http://127.0.0.1:{port}/v1"
    start = time.monotonic()
    with pytest.raises(EngineUnavailable) as info:
        generate(job(tmp_path, n=2), url, health_check_timeout_s=2)
    assert time.monotonic() - start < 10
    assert f"GET {url}/models" in str(info.value)


def test_a_failing_endpoint_is_taken_out_of_rotation(tmp_path: Path) -> None:
    always_503 = FaultPlan({}, default=[Status(503)] * 1000)
    with FakeOpenAIServer() as good, FakeOpenAIServer(faults=always_503) as bad:
        j = job(tmp_path, n=30)
        result = generate(j, good.url, bad.url, endpoint_max_failures=2, endpoint_pause_s=30)
        assert len(good.requests) >= 30
        # At most one full window of requests (concurrency 8) before the pause.
        assert len(bad.requests) <= 8 + 2, "paused after two failures in a row"
    assert len(result.rows) == 30
    accounted(result, j)


def test_api_key_is_sent_and_never_logged(tmp_path: Path, caplog, monkeypatch) -> None:
    caplog.set_level(logging.DEBUG)
    with FakeOpenAIServer(api_key="sk-secret-123") as server:
        with pytest.raises(EngineUnavailable, match="HTTP 401"):
            generate(job(tmp_path / "nokey", n=2), server.url)
        result = generate(job(tmp_path / "key", n=2), server.url, api_key="sk-secret-123")
    assert len(result.rows) == 2
    assert "sk-secret-123" not in caplog.text
    assert "sk-secret-123" not in (tmp_path / "key" / "journal.jsonl").read_text()


def test_reasoning_and_template_kwargs_go_through(tmp_path: Path) -> None:
    with FakeOpenAIServer(reasoning=True, reasoning_tokens=4, mean_tokens=12) as server:
        j = job(tmp_path, n=4)
        result = run_generation(
            j,
            lambda: OpenAIEngine(
                HttpSettings(
                    endpoints=[server.url],
                    model="fake-model",
                    extra_body={"presence_penalty": 0.5},
                ),
                sampling={**SAMPLING, "top_k": 20, "stop": ["###"]},
                seed=7,
                chat_template_kwargs={"enable_thinking": True},
            ),
            streaming=True,
        )
        bodies = server.requests
    first = result.rows[0]["messages"]
    assert first[1]["reasoning_content"].startswith("Thinking about")
    # The regenerated reasoning is sent back with the history of the next turn.
    follow_up = next(b for b in bodies if b["messages"][-1]["content"] == "follow-up 0")
    assert follow_up["messages"][1]["reasoning_content"] == first[1]["reasoning_content"]
    for b in bodies:
        assert b["chat_template_kwargs"] == {"enable_thinking": True}
        assert b["top_k"] == 20 and b["stop"] == ["###"] and b["seed"] == 7
        assert b["presence_penalty"] == 0.5
    # Reasoning tokens are completion tokens: they count against the budget.
    single = [r for r in result.rows if len(r["turns"]) == 1]
    assert single
    for r in single:
        asked = [{"role": "user", "content": r["messages"][0]["content"]}]
        assert r["usage"]["completion_tokens"] == server.completion_tokens_for(asked)


def test_cancelled_requests_do_not_count_against_the_endpoint(tmp_path: Path, caplog) -> None:
    """A stop (or a reached budget) cancels what is in flight: that is our doing, so the
    endpoint must not be paused or logged as failing."""

    async def cancel_in_flight(url: str) -> list:
        engine = engine_for(url, endpoint_max_failures=2, endpoint_pause_s=30)
        await engine.start()
        try:
            messages = [{"role": "user", "content": "question"}]
            tasks = [asyncio.ensure_future(engine.complete(messages)) for _ in range(8)]
            await asyncio.sleep(0.3)
            assert not any(t.done() for t in tasks), "the server was meant to be slow"
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return engine.pool.endpoints
        finally:
            await engine.close()

    with (
        FakeOpenAIServer(slots=1, tokens_per_s=5, mean_tokens=40) as server,
        caplog.at_level(logging.WARNING),
    ):
        [endpoint] = asyncio.run(cancel_in_flight(server.url))
    assert endpoint.in_flight == 0
    assert endpoint.consecutive_failures == 0
    assert endpoint.paused_until <= time.monotonic()
    assert not [r for r in caplog.records if "failed" in r.getMessage()]


# --------------------------------------------------------------------------- what SGLang does

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def tool_prompt(pid: str, source_calls: int) -> Prompt:
    """A question, the source's turn with ``source_calls`` calls, their results, an answer."""
    calls = [
        {
            "id": f"src_{k}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": "{}"},
        }
        for k in range(source_calls)
    ]
    results = [
        {"role": "tool", "tool_call_id": f"src_{k}", "name": "get_weather", "content": f"r{k}"}
        for k in range(source_calls)
    ]
    messages = [
        {"role": "user", "content": f"weather {pid}"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        *results,
        {"role": "assistant", "content": "source answer"},
    ]
    return Prompt(pid, prompt_hash(messages), messages, [TOOL])


def test_tool_results_answer_the_regenerated_calls(tmp_path: Path) -> None:
    """A regenerated call has a new id (SGLang's are random), and the source's result is
    relinked to it: what a server that checks the pairing accepts (SGLang for MiniMax-M3,
    OpenAI), and what templates that render the ids (Kimi-K2.5's) show the target."""
    j = GenerationJob("A1", [tool_prompt("one", 1)], tmp_path / "j.jsonl", "fake-model", SAMPLING)
    with FakeOpenAIServer(call_tools=True, check_tool_pairing=True) as server:
        result = generate(j, server.url)
        bodies = server.requests
    [row] = result.rows
    _, call_turn, tool, answer = row["messages"]
    [call] = call_turn["tool_calls"]
    assert call["id"].startswith("call_") and call["id"] != "src_0"
    assert tool == {
        "role": "tool",
        "tool_call_id": call["id"],
        "name": "get_weather",
        "content": "r0",
    }
    assert bodies[1]["messages"][2] == tool  # what the server was sent
    assert answer["content"].startswith("Answer to:")
    assert [t["finish_reason"] for t in row["turns"]] == ["tool_calls", "stop"]


def test_results_that_cannot_answer_the_regenerated_calls_fail_the_prompt(tmp_path: Path) -> None:
    """Two source results for one regenerated call: they stay as given; a server that
    checks the pairing refuses that history, and the prompt is recorded as failed with
    its message (real SGLang with Qwen3 accepts it: tests/sglang/test_generate_server)."""
    j = GenerationJob("A1", [tool_prompt("two", 2)], tmp_path / "j.jsonl", "fake-model", SAMPLING)
    with FakeOpenAIServer(call_tools=True, check_tool_pairing=True) as server:
        result = generate(j, server.url)
    assert result.rows == []
    [failure] = result.failures
    assert failure["id"] == "two"
    assert failure["error"] == (
        "turn 2: HTTP 400: tool_call_id 'src_0' does not match an unanswered tool call."
    )


@pytest.mark.parametrize("style", ["sglang", "openai"])
def test_error_messages_of_both_body_shapes_are_recorded(tmp_path: Path, style: str) -> None:
    plan = FaultPlan({"question 1": [Status.context_length_exceeded(1024, 1113)]})
    with FakeOpenAIServer(faults=plan, error_style=style) as server:
        result = generate(job(tmp_path, n=2), server.url)
    [failure] = result.failures
    expected = "The input (1113 tokens) is longer than the model's context length (1024 tokens)."
    assert failure["error"] == f"turn 1: HTTP 400: {expected}"


def test_sglang_error_bodies_give_their_message() -> None:
    from eagle3data.servers.http import error_message

    flat = {"object": "error", "message": "too long", "type": "BadRequestError", "code": 400}
    assert error_message(flat, "") == "too long"
    assert error_message({"error": {"message": "nested"}}, "") == "nested"
    assert error_message({"error": "Unauthorized"}, '{"error":"Unauthorized"}') == "Unauthorized"
    assert error_message({"detail": "Not Found"}, "") == "Not Found"
    assert error_message(None, "<html>bad gateway</html>") == "<html>bad gateway</html>"


def _engine(**settings: object) -> OpenAIEngine:
    http = HttpSettings(endpoints=["http://127.0.0.1:9/v1"], model="m", **settings)  # type: ignore[arg-type]
    return OpenAIEngine(http, sampling=SAMPLING, seed=0)


def _answer(payload: dict, engine: OpenAIEngine | None = None):
    """What the engine makes of ``payload`` from its (only) endpoint."""
    engine = engine or _engine()
    return engine._completion(payload, engine.pool.endpoints[0])


def test_token_ids_are_asked_for_and_read_in_both_servers_shapes() -> None:
    from eagle3data.servers.openai_chat import request_body

    body = request_body(
        [{"role": "user", "content": "hi"}],
        model="m",
        sampling=SAMPLING,
        seed=0,
        chat_template_kwargs={},
        extra_body={},
        return_token_ids=True,
    )
    assert body["return_token_ids"] is True
    recorded = json.loads(
        (Path(__file__).parents[1] / "data" / "sglang" / "chat_token_ids.json").read_text()
    )["response"]
    sglang = _answer(recorded)
    choice = recorded["choices"][0]
    assert sglang.prompt_ids == choice["prompt_token_ids"]
    assert sglang.completion_ids == choice["response_token_ids"]
    assert sglang.reasoning_content == choice["message"]["reasoning_content"]
    # vLLM 0.32: the prompt's ids at the top, the completion's in the choice, the
    # reasoning in message.reasoning.
    vllm = {
        "prompt_token_ids": [1, 2, 3],
        "choices": [
            {
                "message": {"role": "assistant", "content": "x", "reasoning": "because"},
                "finish_reason": "stop",
                "token_ids": [7, 8, 2],
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 3},
    }
    got = _answer(vllm)
    assert (got.prompt_ids, got.completion_ids) == ([1, 2, 3], [7, 8, 2])
    assert got.reasoning_content == "because"
    # A server that ignores the field: no ids, nothing else changes.
    del vllm["prompt_token_ids"], vllm["choices"][0]["token_ids"]
    plain = _answer(vllm)
    assert plain.prompt_ids is plain.completion_ids is None and plain.content == "x"


def test_malformed_token_ids_keep_the_answer_and_turn_the_endpoint_to_text(caplog) -> None:
    payload = {
        "prompt_token_ids": [1, 2],
        "choices": [{"message": {"content": "x"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1},
    }
    for ids, problem in [(None, "without the completion's"), (["a"], "not a list of integers")]:
        engine = _engine()
        payload["choices"][0]["token_ids"] = ids
        with caplog.at_level(logging.WARNING):
            got = _answer(payload, engine)
        assert got.content == "x" and got.prompt_ids is got.completion_ids is None
        assert not engine.pool.endpoints[0].token_ids and engine.notes["token_ids_fallbacks"] == 1
        assert problem in caplog.text


@pytest.mark.parametrize("asked", [True, False])
def test_token_ids_are_asked_for_unless_turned_off(tmp_path: Path, asked: bool) -> None:
    with FakeOpenAIServer() as server:
        result = generate(job(tmp_path, 4), server.url, return_token_ids=asked)
        bodies = server.requests
    assert bodies and all(b.get("return_token_ids", False) is asked for b in bodies)
    # The fake sends no ids: every turn says so, and the run is otherwise the same.
    assert all(t["token_ids"] is None for r in result.rows for t in r["turns"])
    assert result.stats["turns_without_token_ids"] == sum(len(r["turns"]) for r in result.rows)


# --- a server that does not take return_token_ids (issue 32, point 6) -----------------


def _nested_ids(body, message):
    """Ids in lists of lists, where the dialect puts its ids: no shape we know."""
    return [[1, 2, 3]], [[4, 5]]


def _ids_fallback_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and "return_token_ids" in r.getMessage()
    ]


def _every_prompt_answered_without_ids(result, j: GenerationJob) -> None:
    assert result.failures == [] and result.stats["failed"] == 0
    assert [r["id"] for r in result.rows] == [p.id for p in j.prompts]
    journal = [json.loads(line) for line in j.journal.read_text().splitlines()]
    assert all(rec["status"] == "ok" for rec in journal), "nothing journaled as failed"
    assert all(t["token_ids"] is None for r in result.rows for t in r["turns"])
    assert result.stats["token_ids_fallbacks"] == 1
    accounted(result, j)


def test_a_server_that_refuses_return_token_ids_is_asked_in_text(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.WARNING)
    with FakeOpenAIServer(refuse_fields=["return_token_ids"]) as server:
        j = job(tmp_path, n=12)
        result = generate(j, server.url)
        bodies = server.requests
    _every_prompt_answered_without_ids(result, j)
    assert len(_ids_fallback_warnings(caplog)) == 1
    # Once refused, the endpoint is asked without the field; what was refused is asked again.
    refused = sum(1 for b in bodies if "return_token_ids" in b)
    assert 1 <= refused <= 8, "at most the first requests in flight carried the field"
    assert len(bodies) - refused == sum(len(r["turns"]) for r in result.rows)


def test_an_unrelated_400_that_echoes_the_request_keeps_the_ids(tmp_path: Path, caplog) -> None:
    """vLLM's 400 for a validation error echoes the whole request, return_token_ids too:
    naming the field is not refusing it. The prompt fails; the endpoint keeps the ids."""
    caplog.set_level(logging.WARNING)
    echo = Status(
        400,
        "[{'type': 'value_error', 'loc': ('body',), 'msg': 'Value error, bad stop list', "
        "'input': {'model': 'fake-model', 'return_token_ids': True}}]",
    )
    with FakeOpenAIServer(faults=FaultPlan({"question 1": [echo]})) as server:
        j = job(tmp_path, n=8)
        result = generate(j, server.url)
        asked_for_ids = sum(1 for b in server.requests if "return_token_ids" in b)
    assert [f["id"] for f in result.failures] == ["p001"]
    assert not [w for w in _ids_fallback_warnings(caplog) if "asking it in text" in w]
    assert result.stats["token_ids_fallbacks"] == 0
    assert asked_for_ids == len(server.requests)


def test_prompts_over_the_context_do_not_count_as_a_broken_server(tmp_path: Path) -> None:
    """Every prompt cut by vLLM's context clamp fails as over-context; that says nothing
    about the server, so the error limits (3 in a row) do not stop the run."""
    prompts = [
        make_prompt(f"long{i}", [{"role": "user", "content": f"{LONG_QUESTION} {i}"}])
        for i in range(8)
    ]
    j = dataclasses.replace(job(tmp_path), prompts=prompts)
    with FakeOpenAIServer(dialect="vllm", max_model_len=80, tokens_fn=_wanted_tokens) as server:
        result = generate(j, server.url, limits=ErrorLimits(max_consecutive_failures=3))
    assert result.stats["over_context"] == 8 and not result.rows
    accounted(result, j)


def test_ids_in_an_unknown_shape_fall_back_to_text_without_retries(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.WARNING)
    with FakeOpenAIServer(dialect="vllm", token_ids_fn=_nested_ids) as server:
        j = job(tmp_path, n=12)
        result = generate(j, server.url, limits=ErrorLimits(max_consecutive_failures=3))
        received = server.stats["received"]
        asked_for_ids = sum(1 for b in server.requests if "return_token_ids" in b)
    _every_prompt_answered_without_ids(result, j)
    assert len(_ids_fallback_warnings(caplog)) == 1
    assert received == sum(len(r["turns"]) for r in result.rows), "no request asked twice"
    assert 1 <= asked_for_ids <= 8, "only the first requests in flight asked for ids"
    assert result.rows[1]["messages"][-1]["content"].startswith("Answer to: question 1")


# --- vLLM clamps max_tokens to the context (issue 32, point 7) ------------------------

# The fake counts a prompt as its words plus one per message: "question 1" is 3 tokens,
# and a user turn of 30 words is 31. With a context of 80 and max_tokens 64 the long prompt
# fits (31 < 80) but not with its max_tokens (31 + 64 > 80).
LONG_QUESTION = " ".join(["long"] * 30)


def _context_prompts() -> list[Prompt]:
    return [
        make_prompt("short", [{"role": "user", "content": "question 1"}]),
        make_prompt("long", [{"role": "user", "content": LONG_QUESTION}]),
        make_prompt("capped", [{"role": "user", "content": "question 2"}]),
    ]


def context_job(tmp_path: Path) -> GenerationJob:
    """:func:`job` over the prompts of :func:`_context_prompts`."""
    return dataclasses.replace(job(tmp_path), prompts=_context_prompts())


def _wanted_tokens(messages) -> int:
    """Answer lengths before any cap: 'question 2' asks past max_tokens (64)."""
    return 100 if "question 2" in messages[-1]["content"] else 60


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_an_answer_cut_by_the_context_is_over_context_not_data(
    tmp_path: Path, dialect: str
) -> None:
    j = context_job(tmp_path)
    with FakeOpenAIServer(dialect=dialect, max_model_len=80, tokens_fn=_wanted_tokens) as server:
        result = generate(j, server.url)
        completed = server.stats["completion_tokens"]
    # vLLM answered the long prompt with 80 - 31 = 49 tokens and "length"; SGLang refused it.
    [failure] = result.failures
    assert failure["id"] == "long" and failure["kind"] == "over_context"
    assert "80" in failure["error"] and "context" in failure["error"]
    assert [r["id"] for r in result.rows] == ["short", "capped"]
    capped = result.rows[1]
    assert capped["finish_reason"] == "length", "max_tokens itself still cuts answers"
    assert capped["usage"]["completion_tokens"] == 64
    assert result.stats["over_context"] == 1
    # The clamped answer's tokens were generated and are not in the output: waste, not
    # budget (the budget counts the output only).
    clamped = 49 if dialect == "vllm" else 0
    assert completed == 60 + 64 + clamped
    assert result.stats["completion_tokens"] == 60 + 64
    assert result.stats["generated_tokens_total"] == completed
    assert result.stats["waste_tokens"] == clamped
    journal = {json.loads(x)["id"]: json.loads(x) for x in j.journal.read_text().splitlines()}
    assert journal["long"]["completion_tokens_spent"] == clamped
    accounted(result, j)


def test_the_context_is_read_from_the_servers_models(tmp_path: Path) -> None:
    with FakeOpenAIServer(dialect="vllm", max_model_len=80) as server:
        engine = engine_for(server.url)

        async def started() -> list:
            await engine.start()
            try:
                return [e.max_model_len for e in engine.pool.endpoints]
            finally:
                await engine.close()

        assert asyncio.run(started()) == [80]


def test_the_status_reports_the_counters_of_the_generate_stats(tmp_path: Path) -> None:
    from dataclasses import replace

    from eagle3data.atomic import write_json
    from eagle3data.layout import RESPONSE_STATS, Results
    from eagle3data.monitor.snapshot import _generation_notes, notes_lines

    j = context_job(tmp_path)
    with FakeOpenAIServer(
        dialect="vllm", max_model_len=80, tokens_fn=_wanted_tokens, token_ids_fn=_nested_ids
    ) as server:
        result = generate(j, server.url)
    results = Results(tmp_path)
    write_json(results.path(RESPONSE_STATS, dataset="A1"), result.stats)
    notes = _generation_notes(results, "A1")
    assert notes == {"over_context": 1, "token_ids_fallbacks": 1, "capture_files_left": 0}
    row = _status_row("A1", notes)
    [_title, line] = notes_lines([row, replace(row, dataset="B2", generation_notes=None)])
    assert line.startswith("  A1: 1 prompt(s) over the model's context")
    assert "1 endpoint(s) refused return_token_ids" in line
    assert "could not be deleted" not in line
    [_title, line] = notes_lines([replace(row, generation_notes={"capture_files_left": 3})])
    assert line == (
        "  A1: 3 hidden-state file(s) a capture server wrote for generation requests could "
        "not be deleted (see the job log)"
    )
    assert notes_lines([replace(row, generation_notes={"over_context": 0})]) == []


def _status_row(dataset: str, notes: dict[str, int] | None):
    from dataclasses import fields

    from eagle3data.monitor.snapshot import DatasetStatus

    blank = {f.name: None for f in fields(DatasetStatus)}
    return DatasetStatus(**{**blank, "dataset": dataset, "generation_notes": notes})


def _recorded(server: str, name: str) -> dict:
    return json.loads((Path(__file__).parents[1] / "data" / server / f"{name}.json").read_text())


def test_what_real_servers_sent_about_the_context_is_over_context() -> None:
    """vLLM 0.32 and SGLang 0.5.23 recorded on a 1024-token model: a 1013-token prompt
    with max_tokens 100, and prompts longer than the context."""
    from eagle3data.generation.engines import OVER_CONTEXT, TurnFailure
    from eagle3data.generation.engines.openai_engine import failure_kind
    from eagle3data.servers.http import error_message, models_entry, served_context_length

    for server in ("vllm", "sglang"):
        models = _recorded(server, "models")["response"]
        assert served_context_length(models_entry(models, "tiny-qwen3")) == 1024
        # the only one
        assert served_context_length(models_entry(models, "served-under-another-name")) == 1024
        refused = _recorded(server, "error_context_too_long")["response"]
        assert failure_kind(error_message(refused, "")) == OVER_CONTEXT
    sglang = _recorded("sglang", "error_context_with_max_tokens")["response"]
    assert failure_kind(error_message(sglang, "")) == OVER_CONTEXT
    clamped = _recorded("vllm", "error_context_with_max_tokens")
    engine = OpenAIEngine(
        HttpSettings(endpoints=["http://127.0.0.1:9/v1"], model="tiny-qwen3"),
        sampling={**SAMPLING, "max_tokens": clamped["request"]["max_tokens"]},
        seed=0,
    )
    engine.pool.endpoints[0].max_model_len = 1024
    got = engine._completion(clamped["response"], engine.pool.endpoints[0])
    assert isinstance(got, TurnFailure) and got.kind == OVER_CONTEXT
    assert got.spent_tokens == 11 and "1024" in got.reason
    # Without a reported context the answer is kept: nothing says where it ended.
    engine.pool.endpoints[0].max_model_len = None
    kept = engine._completion(clamped["response"], engine.pool.endpoints[0])
    assert not isinstance(kept, TurnFailure) and kept.finish_reason == "length"
    # An answer cut by max_tokens itself is data, however close to the context.
    normal = _recorded("vllm", "chat_token_ids_length")
    engine.pool.endpoints[0].max_model_len = normal["response"]["usage"]["total_tokens"]
    engine.sampling["max_tokens"] = normal["request"]["max_tokens"]
    assert not isinstance(
        engine._completion(normal["response"], engine.pool.endpoints[0]), TurnFailure
    )


def test_requests_are_written_in_the_order_they_were_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst opens a connection per request, and connection setups take varying times (a
    loaded machine, a remote server): the requests must still go out in the prompts' order,
    each written whole before the next, so that a first-come-first-served server runs the
    positions the prefix needs first, and the queue gauges read its waiting requests as
    this client's newest."""
    import random

    import aiohttp
    from aiohttp.http_writer import StreamWriter

    rng = random.Random(0)
    connect, write = aiohttp.TCPConnector._create_connection, StreamWriter.write
    written: list[str] = []

    async def slow_connect(self, *args, **kwargs):
        await asyncio.sleep(rng.uniform(0.0, 0.05))
        return await connect(self, *args, **kwargs)

    async def recording_write(self, chunk, *args, **kwargs):
        if b'"messages"' in bytes(chunk):
            written.append(json.loads(bytes(chunk))["messages"][0]["content"])
        return await write(self, chunk, *args, **kwargs)

    monkeypatch.setattr(aiohttp.TCPConnector, "_create_connection", slow_connect)
    monkeypatch.setattr(StreamWriter, "write", recording_write)
    single = [make_prompt(f"s{i:03d}", [{"role": "user", "content": f"q {i}"}]) for i in range(32)]
    with FakeOpenAIServer(slots=32, tokens_per_s=400, mean_tokens=20) as server:
        j = dataclasses.replace(job(tmp_path), prompts=single)
        result = generate(j, server.url, concurrency=32)
    assert len(result.rows) == 32
    assert written == [f"q {i}" for i in range(32)]


def test_capture_files_that_cannot_be_deleted_are_counted_and_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vLLM server with the hidden-states connector writes a file for every generation
    request (57 KB a token at Kimi width): the generate job deletes it; where it cannot
    (the server's storage is not this machine's, or the file is another user's), each
    file left is counted in the stats and the log warns once per endpoint and cause."""
    engine = _engine()
    endpoint = engine.pool.endpoints[0]

    def answer_with(path: Path) -> dict:
        return {"kv_transfer_params": {"hidden_states_path": str(path)}}

    here = tmp_path / "cmpl-1.safetensors"
    here.write_bytes(b"states")
    asyncio.run(engine._discard_captured_states(answer_with(here), endpoint))
    assert not here.exists() and engine.notes["capture_files_left"] == 0

    with caplog.at_level(logging.WARNING):
        for n in range(3):  # the server's storage, not visible here
            elsewhere = tmp_path / "not-here" / f"cmpl-{n}.safetensors"
            asyncio.run(engine._discard_captured_states(answer_with(elsewhere), endpoint))
        owned = tmp_path / "cmpl-root.safetensors"
        owned.write_bytes(b"states")

        def refused(path: str) -> None:
            raise PermissionError(13, "Operation not permitted", path)

        monkeypatch.setattr("os.unlink", refused)
        for _ in range(2):  # written by a server running as another user
            asyncio.run(engine._discard_captured_states(answer_with(owned), endpoint))
    assert engine.notes["capture_files_left"] == 5
    warnings = [r.getMessage() for r in caplog.records if "captures hidden states" in r.message]
    assert len(warnings) == 2, warnings
    assert "not on this machine" in warnings[0] and "another" in warnings[1]
