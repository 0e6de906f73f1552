"""The generate rule against real vLLM: ``generation.backend: openai`` talking to vLLM
0.32's ``api_server`` on CPU (``tests/support/vllm_server.py``, whose docstring lists what
was checked), serving a tiny random Qwen3 (head size 32) with Qwen3's real thinking
template, the ``qwen3`` reasoning parser and the ``hermes`` tool-call parser. The server
runs from ``.venv-vllm``; these tests and the workflow from ``.venv``.

One server serves the whole module. What the server sent is recorded into
``tests/data/vllm/`` (re-record: ``EAGLE3DATA_RECORD_VLLM=tests/data/vllm .venv/bin/pytest
tests/vllm/test_vllm_generate.py -k sends``, or ``PYTHONPATH=tests .venv/bin/python -m
support.vllm_server``); ``tests/unit/test_fake_openai.py`` holds the fake server's vLLM
dialect to those shapes.

Nothing here asserts generated text (a random model's greedy text is whatever the CPU's
kernels make of near-ties); the model's lengths are pinned by ``ignore_eos`` where a test
needs them, and its tool calls by the server's grammar (``tool_choice: required``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from support.real_servers import (
    QUESTION,
    SERVED_MODEL,
    WEATHER_TOOL,
    assert_shapes_as_recorded,
    budget_workflow,
    check_budget_run,
    check_tool_rows,
    kill_mid_run,
    record_bodies,
    resume_killed_run,
    resume_workflows,
    server_log_on_failure,
    server_workflow,
    tool_workflow,
)
from support.target_models import make_qwen3_dir
from support.vllm_server import (
    HEAD_DIM,
    RECORD_ENV,
    RECORDED_DIR,
    RequestLog,
    VLLMServer,
    thinking_fields,
    vllm_recording_cases,
)
from support.workflow import sharegpt_prompts, write_prompts

from eagle3data.chat import render
from eagle3data.turn_ids import turn_token_ids

pytestmark = pytest.mark.e2e

MAX_NUM_SEQS = 4  # requests the server decodes together; the rest wait

# The budget test's own server. vLLM admits concurrent requests nearly, not exactly, in
# arrival order (seen: 0, 1, 4, 6 first of 8), and the test needs the three it decides on
# among the first admitted: 6 of 8 leaves room for swaps. And its answers must take seconds:
# on a fast 2-core machine (an Intel one of this workplace) 8 layers decode 4 answers of 900
# tokens in 3.7 s, and the job, sharing its core with vLLM's API server, took them in only
# after every request had ended, so nothing was left to cancel (4 of 5 runs); 24 layers take
# about 10 s.
BUDGET_MAX_NUM_SEQS = 6
BUDGET_LAYERS = 24


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen3_dir(tmp_path_factory.mktemp("qwen3") / "tiny-qwen3", head_dim=HEAD_DIM)


@pytest.fixture(scope="module")
def tokenizer(qwen3_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_dir)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, qwen3_dir: Path) -> Iterator[VLLMServer]:
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    with VLLMServer(qwen3_dir, log_path=log, max_num_seqs=MAX_NUM_SEQS) as running:
        print(f"\nvLLM server ready in {running.startup_s:.0f} s (log: {log})")
        yield running
    print(f"\nvLLM server stopped in {running.stop_s:.1f} s, no process of it left")


@pytest.fixture
def budget_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    base = tmp_path_factory.mktemp("vllm-budget-server")
    model = make_qwen3_dir(base / "deeper-qwen3", head_dim=HEAD_DIM, layers=BUDGET_LAYERS)
    with VLLMServer(
        model, log_path=base / "server.log", max_num_seqs=BUDGET_MAX_NUM_SEQS
    ) as running:
        yield running


def log_on_failure(server: VLLMServer, offset: int) -> contextlib.AbstractContextManager[None]:
    return server_log_on_failure(server, offset, "vLLM server")


def finished_since(server: VLLMServer, before: Mapping[str, float]) -> dict[str, int]:
    """Requests that ended in the engine since ``before`` (a :meth:`finished_counts`), by
    finish reason, the ones that did."""
    now = server.finished_counts()
    return {k: int(v - before.get(k, 0.0)) for k, v in now.items() if v > before.get(k, 0.0)}


def wait_until_settled(
    server: VLLMServer, offset: int, before: Mapping[str, float]
) -> tuple[RequestLog, dict[str, int]]:
    """Wait (bounded) until the engine holds no request and every request it got since
    ``offset`` either finished or was aborted; returns (the request log, finished since
    ``before`` by reason)."""
    deadline = time.monotonic() + 60
    while True:
        log, finished = server.requests_since(offset), finished_since(server, before)
        settled = len(log.aborted) + sum(finished.values()) >= len(log.received)
        if (settled and server.in_engine() == 0) or time.monotonic() > deadline:
            return log, finished
        time.sleep(0.5)


@contextlib.contextmanager
def peak_running(server: VLLMServer, interval: float = 0.05) -> Iterator[list[int]]:
    """Poll ``vllm:num_requests_running`` while the block runs; yields a list whose one
    item is the most seen at once."""
    peak, stop = [0], threading.Event()

    def poll() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                running = server.metrics().get("vllm:num_requests_running", 0.0)
                peak[0] = max(peak[0], int(running))
            stop.wait(interval)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join(10)


def wire(message: Mapping[str, Any]) -> dict[str, Any]:
    """A history message as ``/tokenize`` must be given it to render what chat completions
    render: the fields the engine sends, ``reasoning_content`` named ``reasoning`` (chat
    completions rename it themselves; /tokenize drops it)."""
    keys = ("role", "content", "tool_calls", "tool_call_id", "name")
    out = {k: v for k, v in message.items() if k in keys}
    if message.get("reasoning_content") is not None:
        out["reasoning"] = message["reasoning_content"]
    return out


def as_vllm_renders(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tools as vLLM's chat completions hand them to the template: re-serialised by its
    ChatCompletionToolsParam and FunctionDefinition models, keys in their order (type,
    function: name, description, parameters, strict), ``description`` null when absent,
    ``strict`` dropped when absent, unknown keys dropped; ``parameters`` as sent."""
    out = []
    for tool in tools:
        f = tool["function"]
        function = {"name": f["name"], "description": f.get("description")}
        function["parameters"] = f.get("parameters")
        if f.get("strict") is not None:
            function["strict"] = f["strict"]
        out.append({"type": "function", "function": function})
    return out


def assert_ids_as_served(
    server: VLLMServer,
    row: Mapping[str, Any],
    chat_template_kwargs: Mapping[str, Any],
    tools: list[dict[str, Any]] | None = None,
) -> None:
    """Every turn of ``row`` kept the ids vLLM returned: its prompt ids are vLLM's own
    render of the history before it (``/tokenize``), its completion ids as many as
    ``usage.completion_tokens``. ``tools``: as the source gave them (the row keeps them with
    its keys sorted, the request sends them as given, and the order reaches the prompt)."""
    turns = row["turns"]
    ids = turn_token_ids(turns)
    answers = [i for i, m in enumerate(row["messages"]) if m["role"] == "assistant"]
    assert len(ids) == len(answers) == len(turns), row["id"]
    for k, (at, turn, pair) in enumerate(zip(answers, turns, ids, strict=True)):
        assert pair is not None, f"{row['id']} turn {k}: no token ids"
        prompt, completion = pair
        history = [wire(m) for m in row["messages"][:at]]
        fields: dict[str, Any] = {"chat_template_kwargs": dict(chat_template_kwargs)}
        if tools:
            fields["tools"] = tools
        assert prompt == server.tokenize(history, **fields), f"{row['id']} turn {k}"
        assert len(prompt) == turn["prompt_tokens"], f"{row['id']} turn {k}"
        assert len(completion) == turn["completion_tokens"], f"{row['id']} turn {k}"


# --------------------------------------------------------------------------- the bodies


def test_what_the_server_sends(server: VLLMServer, tokenizer: Any, tmp_path: Path) -> None:
    """Record every kind of body and check the facts the support module states about them;
    the committed recordings must still have the shapes the server sends now."""
    offset = server.log_offset()
    cases = vllm_recording_cases(tokenizer, server.model_name or SERVED_MODEL)
    records = record_bodies(server, tokenizer, cases, os.environ.get(RECORD_ENV) or tmp_path)
    r = {name: record["response"] for name, record in records.items()}
    status = {name: record["status"] for name, record in records.items()}
    eos, paris = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("Paris")
    with log_on_failure(server, offset):
        [model] = r["models"]["data"]
        assert (model["id"], model["owned_by"], model["max_model_len"]) == (
            SERVED_MODEL,
            "vllm",
            1024,
        )
        assert model["root"] == str(server.model)

        # Thinking on: everything before a </think> is reasoning, in message.reasoning.
        thinking = r["chat_thinking"]
        choice, usage = thinking["choices"][0], thinking["usage"]
        assert choice["finish_reason"] == "length" and usage["completion_tokens"] == 8
        message = choice["message"]
        assert message["reasoning"] and "reasoning_content" not in message
        assert message["content"] is None  # null, where SGLang sends ""
        assert usage["completion_tokens_details"] == {"reasoning_tokens": 8}
        assert "reasoning_tokens" not in usage
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert {"stop_reason", "token_ids", "logprobs"} <= choice.keys()
        assert choice["token_ids"] is None  # not asked for
        assert thinking["prompt_token_ids"] is None

        plain = r["chat_no_thinking"]
        message = plain["choices"][0]["message"]
        assert message["reasoning"] is None and isinstance(message["content"], str)
        assert plain["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}

        stop_eos = r["chat_stop_eos"]["choices"][0]
        assert (stop_eos["finish_reason"], stop_eos["stop_reason"]) == ("stop", None)
        assert stop_eos["message"]["content"] == ""
        assert r["chat_stop_eos"]["usage"]["completion_tokens"] == 1
        stop = r["chat_stop_string"]["choices"][0]
        assert (stop["finish_reason"], stop["stop_reason"]) == ("stop", "Paris")
        assert stop["message"]["content"] == ""  # the stop string is cut from the text

        called = r["chat_tool_call"]["choices"][0]
        assert called["finish_reason"] == "tool_calls" and called["message"]["content"] == ""
        [call] = called["message"]["tool_calls"]
        assert call.keys() == {"id", "type", "function"}  # no "index", unlike SGLang's
        assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", call["id"])
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Berlin")

        # return_token_ids: the prompt's at the top level, the completion's in the choice.
        user = [{"role": "user", "content": QUESTION}]
        for name, kwargs in (
            ("chat_token_ids", {}),
            ("chat_token_ids_length", {"enable_thinking": False}),
        ):
            with_ids = r[name]
            choice = with_ids["choices"][0]
            assert "prompt_token_ids" not in choice, name
            assert choice["finish_reason"] == "length", name
            assert len(choice["token_ids"]) == with_ids["usage"]["completion_tokens"] == 8, name
            ours = render(tokenizer, user, add_generation_prompt=True, chat_template_kwargs=kwargs)
            expected = tokenizer.encode(ours, add_special_tokens=False)
            assert with_ids["prompt_token_ids"] == expected, name
            assert server.tokenize(user, chat_template_kwargs=kwargs) == expected, name
        # The end token is in the ids and counted; so is a stop string's token, which
        # the text leaves out.
        ended = r["chat_token_ids_eos"]
        assert ended["choices"][0]["finish_reason"] == "stop"
        assert ended["choices"][0]["token_ids"][-1] == eos
        assert ended["usage"]["completion_tokens"] == len(ended["choices"][0]["token_ids"]) == 4
        stopped = r["chat_token_ids_stop_string"]
        assert stopped["choices"][0]["stop_reason"] == "Paris"
        assert stopped["choices"][0]["token_ids"] == [paris]
        assert stopped["choices"][0]["message"]["content"] == ""
        assert stopped["usage"]["completion_tokens"] == 1

        # History with reasoning, a call and its result is rendered, but the tools reach
        # the template re-serialised by vLLM's model: keys in its order.
        history = records["chat_history"]
        messages, tools = history["request"]["messages"], history["request"]["tools"]
        assert status["chat_history"] == 200
        assert "I should look it up." in history["prompt_text"]
        assert "<tool_response>\nsunny\n</tool_response>" in history["prompt_text"]
        as_sent = render(tokenizer, messages, tools=tools, add_generation_prompt=True)
        assert history["prompt_text"] != as_sent
        assert history["prompt_text"] == render(
            tokenizer, messages, tools=as_vllm_renders(tools), add_generation_prompt=True
        )
        # /tokenize renders the same (its tools re-serialised the same way) only with the
        # history's reasoning named "reasoning": it does not rename reasoning_content as
        # chat completions do, and drops it.
        prompt_ids = history["response"]["prompt_token_ids"]
        assert server.tokenize([wire(m) for m in messages], tools=tools) == prompt_ids
        assert server.tokenize(messages, tools=tools) != prompt_ids

        # Errors: OpenAI's nested body. A prompt longer than the context is a 400; one that
        # fits but not with max_tokens gets what is left (max_tokens clamped: 200).
        for name in ("error_context_too_long", "error_malformed"):
            assert status[name] == 400, name
            assert r[name].keys() == {"error"}, name
            assert r[name]["error"].keys() == {"message", "type", "param", "code"}, name
            assert r[name]["error"]["code"] == 400, name
        too_long = r["error_context_too_long"]["error"]
        assert (too_long["type"], too_long["param"]) == ("BadRequestError", "input_tokens")
        assert too_long["message"].startswith("This model's maximum context length is 1024")
        assert r["error_malformed"]["error"]["type"] == "Bad Request"
        clamped = r["error_context_with_max_tokens"]
        assert status["error_context_with_max_tokens"] == 200
        assert clamped["choices"][0]["finish_reason"] == "length"
        assert clamped["usage"]["total_tokens"] == 1024

        # Only what reached the engine is logged: not the two 400s.
        assert len(server.requests_since(offset).received) == len(cases) - 3

    assert_shapes_as_recorded(records, RECORDED_DIR, "module docstring")


# --------------------------------------------------------------------------- the generate rule


def test_reasoning_budget_batching_and_cancelled_requests(
    budget_server: VLLMServer, tokenizer: Any, tmp_path: Path
) -> None:
    """Thinking on, 8 requests sent at once to a server that decodes 6 together, a budget
    of 2.5 answers: the first two fit and the third decides the prefix while the others
    decode or wait on the server; those must be aborted there, not run to their end."""
    # Long answers: the 2 that wait start as soon as the first answers end, and must still
    # be decoding when the cancel reaches the server (a job starved by other work once took
    # 3 s to cancel). 900 tokens of the 24-layer model take about 10 s.
    max_tokens = 900
    # Reasoning to parse: the model's greedy <think> forbidden.
    server = budget_server
    wf, order = budget_workflow(
        tmp_path, server.model, server, max_tokens, thinking_fields(tokenizer)
    )
    offset, before = server.log_offset(), server.finished_counts()
    with peak_running(server) as peak:
        wf.run("results/responses/A1.jsonl")
    log, finished = wait_until_settled(server, offset, before)

    with log_on_failure(server, offset):
        # vLLM's message.reasoning became the rows' reasoning_content.
        rows, journaled, cancelled = check_budget_run(wf, order, max_tokens)
        for row in rows:
            assert_ids_as_served(server, row, {"enable_thinking": True})

        # Server side: all 8 arrived; it decoded several together; what we journaled ran
        # to its end, and every request we dropped, decoding or waiting, was aborted at
        # once and never finished (vLLM logs each abort; its request_success_total does
        # not count them as "abort": the support module).
        seen = f"{log}, finished {finished}, journaled {journaled}, cancelled {cancelled}"
        assert len(log.received) == 8, seen
        assert 2 <= peak[0] <= BUDGET_MAX_NUM_SEQS, peak
        # Every request either ran to its end or was aborted; what we journaled ran to its
        # end. A request of the decisive batch can end on the server in the same step as
        # the answer that decided the budget, and reach us after it: cancelled here,
        # finished there (seen on a fast machine: 6 finished, 3 journaled). The requests
        # still decoding when the cancel came were aborted, at least one: those waiting.
        ran = finished.get("length", 0)
        assert set(finished) <= {"length"} and ran + len(log.aborted) == 8, seen
        assert journaled <= ran, seen
        assert 1 <= len(log.aborted) <= cancelled and set(log.aborted) <= set(log.received), seen
        assert server.in_engine() == 0
        # vLLM says nothing of what a dropped request had decoded: estimated, and marked.
        stats = wf.stats("A1")
        assert stats["abandoned_tokens_estimated"] == stats["abandoned_tokens"], stats
    print(f"\n{peak[0]} decoded at once; cancelled {cancelled}, aborted {len(log.aborted)}")


def test_thinking_off_gives_content_and_the_ids_of_each_turn(
    server: VLLMServer, qwen3_dir: Path, tmp_path: Path
) -> None:
    """Thinking off (the template closes the think block): answers are content, no
    reasoning; multi-turn prompts keep each turn's ids as vLLM rendered them."""
    prompts = write_prompts(tmp_path / "B1.jsonl", sharegpt_prompts(6))
    off = {"enable_thinking": False}
    wf = server_workflow(
        tmp_path,
        qwen3_dir,
        server,
        {"B1": {"path": str(prompts), "format": "sharegpt"}},
        chat_template_kwargs=off,
        concurrency=3,
        sampling={"temperature": 0.0, "max_tokens": 24},
    )
    offset = server.log_offset()
    wf.run("results/responses/B1.jsonl")
    with log_on_failure(server, offset):
        rows = {row["id"]: row for row in wf.responses("B1")}
        assert len(rows) == 6 and len(rows["q0005"]["turns"]) == 2
        for row in rows.values():
            for answer in (m for m in row["messages"] if m["role"] == "assistant"):
                assert isinstance(answer["content"], str) and "reasoning_content" not in answer
            assert_ids_as_served(server, row, off)
        assert wf.stats("B1")["turns_without_token_ids"] == 0


def test_tool_calls_are_parsed_into_the_rows(
    server: VLLMServer, qwen3_dir: Path, tokenizer: Any, tmp_path: Path
) -> None:
    """Thinking off, the call forced by vLLM's grammar and parsed by ``hermes``: each
    regenerated turn is a parsed call, the source's tool result relinked to it."""
    wf = tool_workflow(tmp_path, qwen3_dir, server, tokenizer)
    offset = server.log_offset()
    wf.run("results/responses/T1.jsonl")
    with log_on_failure(server, offset):
        rows = check_tool_rows(wf, "chatcmpl-tool-")
        for row in rows.values():
            for turn in row["turns"]:  # the call, then the end token the bias forces
                assert turn["token_ids"]["completion"][-1] == tokenizer.eos_token_id
            assert_ids_as_served(server, row, {"enable_thinking": False}, [WEATHER_TOOL])


def test_a_killed_run_resumes_to_the_uninterrupted_output(
    server: VLLMServer, qwen3_dir: Path, tmp_path: Path
) -> None:
    """SIGKILL the whole Snakemake process tree mid-generation: vLLM aborts what the dead
    job had in flight, and unlock + the same command finishes with the file an
    uninterrupted run against the same server wrote (greedy vLLM with one OpenMP thread
    does not depend on the batch: see the support module)."""
    reference, wf = resume_workflows(tmp_path, qwen3_dir, server, 128)
    offset, before = server.log_offset(), server.finished_counts()
    # Killed once a request is in the engine.
    partial = kill_mid_run(wf, lambda: server.in_engine() > 0)
    log, finished = wait_until_settled(server, offset, before)
    with log_on_failure(server, offset):
        # Every request the dead job left unfinished was aborted, none is left running.
        unfinished = len(log.received) - sum(finished.values())
        assert len(log.aborted) == unfinished, f"{log}, finished {finished}"
        assert server.in_engine() == 0
    print(f"\nkilled after {len(partial)} of 10 records; the server aborted {unfinished}")

    resume_killed_run(wf, partial, reference)
    for row in wf.responses("A1"):
        assert_ids_as_served(server, row, {"enable_thinking": False})
