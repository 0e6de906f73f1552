"""The generate rule against real SGLang: ``generation.backend: openai`` talking to
``sglang.launch_server`` on CPU (``tests/support/sglang_server.py``, whose docstring lists
what was checked), serving a tiny random Qwen3 with Qwen3's real thinking template, with the
``qwen3`` reasoning parser and the ``qwen`` tool-call parser.

One server serves the whole module. What the server sent is recorded into
``tests/data/sglang/`` (re-record: ``EAGLE3DATA_RECORD_SGLANG=tests/data/sglang
.venv-sglang/bin/pytest tests/sglang/test_generate_server.py -k sends``, or ``PYTHONPATH=tests
.venv-sglang/bin/python -m support.sglang_server``); ``tests/unit/test_fake_openai.py``
holds the fake server to those shapes.

Nothing here asserts generated text (a random model's greedy text is whatever the CPU's
kernels make of near-ties); the model's lengths are pinned by ``ignore_eos`` where a test
needs them, and its tool calls by xgrammar (``tool_choice: required``).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.real_servers import (
    QUESTION,
    SERVED_MODEL,
    assert_shapes_as_recorded,
    budget_workflow,
    check_budget_run,
    check_tool_rows,
    kill_mid_run,
    record_bodies,
    recording_cases,
    resume_killed_run,
    resume_workflows,
    server_log_on_failure,
    tool_workflow,
)
from support.sglang_server import RECORD_ENV, RECORDED_DIR, SGLangServer
from support.target_models import make_qwen3_dir

from eagle3data.chat import render

pytestmark = pytest.mark.e2e

ABORTED = "sglang:num_aborted_requests_total"  # appears with the first abort


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen3_dir(tmp_path_factory.mktemp("qwen3") / "tiny-qwen3")


@pytest.fixture(scope="module")
def tokenizer(qwen3_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_dir)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, qwen3_dir: Path) -> Iterator[SGLangServer]:
    log = tmp_path_factory.mktemp("sglang-server") / "server.log"
    # 3 requests decode at once, the rest wait on the server: the cancellation test sends
    # 8 at once (every other test keeps at most 3 in flight).
    extra = ("--max-running-requests", "3")
    with SGLangServer(qwen3_dir, log_path=log, extra_args=extra) as running:
        print(f"\nSGLang server ready in {running.startup_s:.0f} s (log: {log})")
        yield running
    print(f"\nSGLang server stopped in {running.stop_s:.1f} s, no process of it left")


def log_on_failure(server: SGLangServer, offset: int) -> contextlib.AbstractContextManager[None]:
    return server_log_on_failure(server, offset, "SGLang server")


def wait_for_aborts(server: SGLangServer, offset: int, aborted_before: float) -> tuple[Any, int]:
    """Wait (bounded) until every request the server got since ``offset`` either finished
    or was counted aborted; returns (its request log, requests aborted since)."""
    deadline = time.monotonic() + 60
    while True:
        log = server.requests_since(offset)
        aborted = int(server.metrics().get(ABORTED, 0.0) - aborted_before)
        if aborted >= len(log.unfinished) or time.monotonic() > deadline:
            return log, aborted
        time.sleep(0.5)


# --------------------------------------------------------------------------- the bodies


def test_what_the_server_sends(server: SGLangServer, tokenizer: Any, tmp_path: Path) -> None:
    """Record every kind of body and check the facts the support module states about them;
    the committed recordings must still have the shapes the server sends now."""
    offset = server.log_offset()
    cases = recording_cases(tokenizer, server.model_name or SERVED_MODEL)
    records = record_bodies(server, tokenizer, cases, os.environ.get(RECORD_ENV) or tmp_path)
    r = {name: record["response"] for name, record in records.items()}
    status = {name: record["status"] for name, record in records.items()}
    with log_on_failure(server, offset):
        [model] = r["models"]["data"]
        assert (model["id"], model["owned_by"], model["max_model_len"]) == (
            SERVED_MODEL,
            "sglang",
            1024,
        )

        # Thinking on: what the model wrote before any </think> is reasoning.
        thinking = r["chat_thinking"]
        choice, usage = thinking["choices"][0], thinking["usage"]
        assert choice["finish_reason"] == "length" and usage["completion_tokens"] == 8
        assert isinstance(choice["message"]["content"], str)  # "", never null
        assert choice["message"]["reasoning_content"]
        assert 0 < usage["reasoning_tokens"] <= usage["completion_tokens"]
        assert usage["completion_tokens_details"] == {"reasoning_tokens": usage["reasoning_tokens"]}
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert {"matched_stop", "logprobs"} <= choice.keys() and "metadata" in thinking

        plain = r["chat_no_thinking"]
        message = plain["choices"][0]["message"]
        assert message["reasoning_content"] is None and isinstance(message["content"], str)
        assert plain["usage"]["reasoning_tokens"] == 0
        assert plain["usage"]["completion_tokens_details"] is None

        eos = r["chat_stop_eos"]["choices"][0]
        assert (eos["finish_reason"], eos["matched_stop"]) == ("stop", tokenizer.eos_token_id)
        assert (
            eos["message"]["content"] == ""
            and r["chat_stop_eos"]["usage"]["completion_tokens"] == 1
        )
        stop = r["chat_stop_string"]["choices"][0]
        assert (stop["finish_reason"], stop["matched_stop"]) == ("stop", "Paris")
        assert "Paris" not in stop["message"]["content"]

        called = r["chat_tool_call"]["choices"][0]
        assert called["finish_reason"] == "tool_calls" and called["message"]["content"] == ""
        [call] = called["message"]["tool_calls"]
        assert call.keys() == {"id", "index", "type", "function"} and call["id"].startswith("call_")
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Berlin")

        # return_token_ids: the ids in the choice, and the prompt is exactly our render.
        with_ids = r["chat_token_ids"]
        choice = with_ids["choices"][0]
        assert len(choice["response_token_ids"]) == with_ids["usage"]["completion_tokens"]
        ours = render(
            tokenizer, [{"role": "user", "content": QUESTION}], add_generation_prompt=True
        )
        assert choice["prompt_token_ids"] == tokenizer.encode(ours, add_special_tokens=False)

        # History with reasoning, a call and its result is rendered, but every tool gets a
        # "defer_loading": null that the client never sent (SGLang's Tool model).
        history = records["chat_history"]
        messages, tools = history["request"]["messages"], history["request"]["tools"]
        assert status["chat_history"] == 200
        assert "I should look it up." in history["prompt_text"]
        assert "<tool_response>\nsunny\n</tool_response>" in history["prompt_text"]
        as_sent = render(tokenizer, messages, tools=tools, add_generation_prompt=True)
        as_sglang = [{**tool, "defer_loading": None} for tool in tools]
        assert history["prompt_text"] != as_sent
        assert history["prompt_text"] == render(
            tokenizer, messages, tools=as_sglang, add_generation_prompt=True
        )

        # Errors: SGLang's flat body, 400 for a context overflow either way (no clamping).
        for name in ("error_context_too_long", "error_context_with_max_tokens", "error_malformed"):
            assert status[name] == 400, name
            assert r[name].keys() == {"object", "message", "type", "param", "code"}, name
            assert (r[name]["object"], r[name]["code"]) == ("error", 400), name
        assert r["error_context_too_long"]["message"].startswith("The input (")
        assert "context length (1024 tokens)" in r["error_context_too_long"]["message"]
        assert "maximum context length of 1024" in r["error_context_with_max_tokens"]["message"]
        assert r["error_malformed"]["type"] == "Bad Request"

    assert_shapes_as_recorded(records, RECORDED_DIR, "module docstring")


# --------------------------------------------------------------------------- the generate rule


def test_reasoning_usage_budget_and_cancelled_requests(
    server: SGLangServer, qwen3_dir: Path, tmp_path: Path
) -> None:
    """Thinking on, 8 requests sent at once to a server that runs 3 at a time, a budget of
    2.5 answers: the first two fit and the third decides the prefix while the others
    decode or wait on the server; those must be aborted there by their rid, not run to
    their end, and what they had decoded is what the stats count as generated."""
    max_tokens = 256
    # Our client writes the 8 requests in order (openai_engine._InOrder), but the server may
    # still take them in another (its HTTP workers and tokenizer run concurrently; seen once
    # on a loaded 2-core CI machine): when the third position happens to be among the last
    # it runs, nothing is left in flight to abort. Every attempt is checked in full; the
    # aborts must be seen in one of three.
    for attempt in range(3):
        run_dir = tmp_path / f"attempt{attempt}"
        run_dir.mkdir()
        wf, order = budget_workflow(run_dir, qwen3_dir, server, max_tokens)
        offset, before = server.log_offset(), server.metrics()
        wf.run("results/responses/A1.jsonl")
        log, aborted = wait_for_aborts(server, offset, before.get(ABORTED, 0.0))

        with log_on_failure(server, offset):
            _, journaled, cancelled = check_budget_run(wf, order, max_tokens)

            # Server side: all 8 arrived; what we journaled ran to its end; every request
            # we dropped was aborted by its rid, running or waiting: a Finish line of type
            # abort with what it had decoded (0 for one still waiting). A request of the
            # decisive batch can end there just before its abort arrives: finished there,
            # cancelled here, its tokens counted all the same.
            stats = wf.stats("A1")
            seen = f"{log}, journaled {journaled}, cancelled {cancelled}, stats {stats}"
            assert len(log.received) == 8 and not log.unfinished, seen
            ran = [v for v in log.finished.values() if v[0] == "length"]
            stopped = [v for v in log.finished.values() if v[0] == "abort"]
            assert ran == [("length", max_tokens)] * len(ran) and journaled <= len(ran), seen
            assert len(ran) + len(stopped) == 8 and len(stopped) == aborted, seen
            # What the server decoded, to the token, is what we count (nothing estimated).
            assert stats["generated_tokens_total"] == sum(n for _, n in log.finished.values())
            assert stats["abandoned_tokens_estimated"] == 0, seen
        if aborted:
            break
        print(f"\nattempt {attempt}: the server ran the decisive request last; again")
    assert aborted >= 1, seen
    print(f"\ncancelled {cancelled} requests in flight; the server aborted {aborted}")


def test_tool_calls_are_parsed_into_the_rows(
    server: SGLangServer, qwen3_dir: Path, tokenizer: Any, tmp_path: Path
) -> None:
    """Thinking off, the call forced by xgrammar: each regenerated turn is a parsed call.
    The source's tool result answers the regenerated call (its id relinked); where the
    counts differ the results stay as given, and SGLang (Qwen3) accepts that history."""
    wf = tool_workflow(tmp_path, qwen3_dir, server, tokenizer)
    offset = server.log_offset()
    wf.run("results/responses/T1.jsonl")
    with log_on_failure(server, offset):
        check_tool_rows(wf, "call_")


def test_a_killed_run_resumes_to_the_uninterrupted_output(
    server: SGLangServer, qwen3_dir: Path, tmp_path: Path
) -> None:
    """SIGKILL the whole Snakemake process tree mid-generation: the server aborts what the
    dead job had in flight, and unlock + the same command finishes with the file an
    uninterrupted run against the same server wrote (greedy SGLang on this CPU does not
    depend on the batch: see the support module)."""
    # 192 tokens: over 1 s a request here, so the server sees the dead client while
    # requests run.
    reference, wf = resume_workflows(tmp_path, qwen3_dir, server, 192)
    offset, before = server.log_offset(), server.metrics()
    # Killed once a request is running on the server.
    partial = kill_mid_run(wf, lambda: bool(server.requests_since(offset).unfinished))
    log, aborted = wait_for_aborts(server, offset, before.get(ABORTED, 0.0))
    with log_on_failure(server, offset):
        # Every request the dead job left unfinished was aborted, none left running. A
        # request in flight at the kill may also finish first: SGLang looks for closed
        # connections only every SGLANG_REQUEST_STATE_WAIT_TIMEOUT (1 s here), and on an
        # idle machine two 48-token requests finished before it looked (CI rehearsal).
        assert aborted >= len(log.unfinished), "what the dead job had in flight: aborted"
    print(f"\nkilled after {len(partial)} of 10 records; the server aborted {aborted} requests")
    resume_killed_run(wf, partial, reference)
