"""The HTTP backend against a fault-injecting OpenAI-compatible server.

Every prompt must end either in the output or in the errors list: none
silently lost, none duplicated, whatever the server does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from pathlib import Path

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


def accounted(result, j: GenerationJob) -> None:
    """Every prompt is in exactly one place; the journal holds no id twice."""
    ids = [p.id for p in j.prompts]
    out = [r["id"] for r in result.rows]
    failed = [f["id"] for f in result.failures]
    beyond = ids[result.stats["prompts"] - result.stats["beyond_limits"] :]
    assert sorted(out + failed + beyond) == sorted(ids)
    journal = [json.loads(line)["id"] for line in j.journal.read_text().splitlines()]
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
    assert result.stats["waste_tokens"] < 0.5 * 1200
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
    kept = [json.loads(line)["id"] for line in j.journal.read_text().splitlines()]
    assert kept, "finished conversations were journaled"
    with FakeOpenAIServer() as server:
        result = generate(j, server.url)
        asked = {p.id for p in j.prompts if server.attempts(p.messages[:1]) > 0}
    assert not asked & set(kept), "nothing journaled is asked again"
    assert result.stats["records_resumed"] == len(kept)
    assert result.rows == reference.rows
    accounted(result, j)


def test_error_rate_limit_stops_the_run(tmp_path: Path) -> None:
    plan = hashed_faults(0.8, Status.context_length_exceeded(), attempts=100)
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
    from eagle3data.generation.engines.openai_engine import error_message

    flat = {"object": "error", "message": "too long", "type": "BadRequestError", "code": 400}
    assert error_message(flat, "") == "too long"
    assert error_message({"error": {"message": "nested"}}, "") == "nested"
    assert error_message({"error": "Unauthorized"}, '{"error":"Unauthorized"}') == "Unauthorized"
    assert error_message({"detail": "Not Found"}, "") == "Not Found"
    assert error_message(None, "<html>bad gateway</html>") == "<html>bad gateway</html>"


def _engine(**settings: object) -> OpenAIEngine:
    http = HttpSettings(endpoints=["http://127.0.0.1:9/v1"], model="m", **settings)  # type: ignore[arg-type]
    return OpenAIEngine(http, sampling=SAMPLING, seed=0)


def test_token_ids_are_asked_for_and_read_in_both_servers_shapes() -> None:
    from eagle3data.generation.engines.openai_engine import request_body

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
    sglang = _engine()._completion(recorded, "u")
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
    got = _engine()._completion(vllm, "u")
    assert (got.prompt_ids, got.completion_ids) == ([1, 2, 3], [7, 8, 2])
    assert got.reasoning_content == "because"
    # A server that ignores the field: no ids, nothing else changes.
    del vllm["prompt_token_ids"], vllm["choices"][0]["token_ids"]
    plain = _engine()._completion(vllm, "u")
    assert plain.prompt_ids is plain.completion_ids is None and plain.content == "x"


def test_malformed_token_ids_are_a_bad_response_shape() -> None:
    from eagle3data.generation.engines import TransientError

    payload = {
        "prompt_token_ids": [1, 2],
        "choices": [{"message": {"content": "x"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1},
    }
    with pytest.raises(TransientError, match="without the completion's"):
        _engine()._completion(payload, "u")
    payload["choices"][0]["token_ids"] = ["a"]
    with pytest.raises(TransientError, match="not a list of integers"):
        _engine()._completion(payload, "u")


@pytest.mark.parametrize("asked", [True, False])
def test_token_ids_are_asked_for_unless_turned_off(tmp_path: Path, asked: bool) -> None:
    with FakeOpenAIServer() as server:
        result = generate(job(tmp_path, 4), server.url, return_token_ids=asked)
        bodies = server.requests
    assert bodies and all(b.get("return_token_ids", False) is asked for b in bodies)
    # The fake sends no ids: every turn says so, and the run is otherwise the same.
    assert all(t["token_ids"] is None for r in result.rows for t in r["turns"])
    assert result.stats["turns_without_token_ids"] == sum(len(r["turns"]) for r in result.rows)
