"""What the suites of real OpenAI-compatible servers share (``tests/sglang/``,
``tests/vllm/``): the request cases whose answers are recorded (``tests/data/sglang/``,
``tests/data/vllm/``) and the recording itself, the JSON shapes they are compared by, the
tool and the tool-calling prompts, and the workflow that points the generate rule at a
running server.

A recording is ``{"request", "status", "response"}`` (plus ``prompt_text``, the decoded
prompt ids, where the server returned them), one JSON file per case;
``tests/unit/test_fake_openai.py`` holds the fake server to the recorded shapes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from eagle3data.prompts.sources import read_prompts, seeded_order
from support.workflow import (
    Workflow,
    kill_group,
    new_workflow,
    sharegpt_prompts,
    write_prompts,
)

SERVED_MODEL = "tiny-qwen3"
QUESTION = "What is the capital of France?"

# A tool whose arguments a grammar can force to an end: strict (SGLang constrains the
# arguments only then), one required enum parameter.
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Berlin"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


class ChatServer(Protocol):
    """What recording and the workflow need of a running server (``LocalServer``)."""

    model_name: str | None
    log_path: Path | None

    @property
    def url(self) -> str: ...

    def chat(self, body: Mapping[str, Any], *, timeout: float = 300.0) -> tuple[int, Any]: ...

    def get(self, path: str) -> tuple[int, Any]: ...

    def log_text(self, offset: int = 0) -> str: ...


def wait_for(predicate: Any, timeout: float = 60.0) -> None:
    """Poll ``predicate`` every 50 ms until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def trimmed_metrics(text: str, names: tuple[str, ...]) -> str:
    """The sample, ``# HELP`` and ``# TYPE`` lines of ``names``."""
    kept = []
    for line in text.splitlines():
        words = line.split()
        name = words[2] if line.startswith("# ") and len(words) > 2 else line.split("{")[0]
        if name in names:
            kept.append(line)
    return "\n".join(kept) + "\n"


def blank_token_ids(tokenizer: Any) -> list[int]:
    """Ids of the tokens that are only whitespace (for ``logit_bias``: a random model
    under a JSON grammar writes blanks forever otherwise)."""
    special = set(tokenizer.all_special_ids)
    return [
        i
        for i in range(len(tokenizer))
        if i not in special and tokenizer.decode([i]).strip() == "" and tokenizer.decode([i])
    ]


def forced_tool_call_body(tokenizer: Any) -> dict[str, Any]:
    """Request fields that make a random model call :data:`WEATHER_TOOL` and then stop:
    the call required (the server's grammar), blanks forbidden, the end token as soon as
    it is allowed (after the call)."""
    bias = {str(i): -100.0 for i in blank_token_ids(tokenizer)}
    bias[str(tokenizer.convert_tokens_to_ids("<|im_end|>"))] = 100.0
    return {"tool_choice": "required", "logit_bias": bias, "parallel_tool_calls": False}


def history_with_reasoning() -> list[dict[str, Any]]:
    """A user turn, an assistant turn with reasoning and a call, and the call's result."""
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I should look it up.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
    ]


def recording_cases(
    tokenizer: Any, model: str = SERVED_MODEL, *, thinking: Mapping[str, Any] | None = None
) -> dict[str, dict[str, Any]]:
    """name -> request (``{"get": path}`` or a chat completion body) of each recording.

    ``thinking``: extra fields of the requests that think (a ``logit_bias`` that keeps a
    random model from writing nothing but ``<think>``, which a parser drops)."""
    user = [{"role": "user", "content": QUESTION}]
    off = {"enable_thinking": False}
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    paris = tokenizer.convert_tokens_to_ids("Paris")
    think = dict(thinking or {})

    def chat(**fields: Any) -> dict[str, Any]:
        return {"model": model, "messages": user, "temperature": 0.0, "max_tokens": 8, **fields}

    return {
        "models": {"get": "/v1/models"},
        "chat_thinking": chat(**think),
        "chat_no_thinking": chat(chat_template_kwargs=off),
        "chat_stop_eos": chat(chat_template_kwargs=off, logit_bias={str(eos): 100.0}),
        "chat_stop_string": chat(
            chat_template_kwargs=off, logit_bias={str(paris): 100.0}, stop=["Paris"]
        ),
        "chat_tool_call": chat(
            chat_template_kwargs=off,
            max_tokens=128,  # the call is ~75 tokens of this byte-level vocabulary
            tools=[WEATHER_TOOL],
            **forced_tool_call_body(tokenizer),
        ),
        "chat_token_ids": chat(return_token_ids=True, **think),
        "chat_history": chat(
            messages=history_with_reasoning(),
            tools=[WEATHER_TOOL],
            max_tokens=4,
            return_token_ids=True,
        ),
        "error_context_too_long": chat(
            messages=[{"role": "user", "content": " ".join(["capital"] * 1100)}]
        ),
        "error_context_with_max_tokens": chat(
            messages=[{"role": "user", "content": " ".join(["capital"] * 1000)}], max_tokens=100
        ),
        "error_malformed": {"model": model, "messages": "hi", "max_tokens": 4},
    }


def returned_prompt_ids(response: Any) -> list[int] | None:
    """The prompt ids of a ``return_token_ids`` answer: in the choice (SGLang) or at the
    top level (vLLM); None when there are none."""
    if not isinstance(response, dict):
        return None
    choices = response.get("choices") or [{}]
    ids = choices[0].get("prompt_token_ids", response.get("prompt_token_ids"))
    return list(ids) if ids is not None else None


def record_bodies(
    server: ChatServer,
    tokenizer: Any,
    cases: Mapping[str, Mapping[str, Any]],
    out_dir: str | os.PathLike[str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Send each case (:func:`recording_cases`) to ``server``; returns name ->
    ``{"request", "status", "response"}`` (plus ``prompt_text``, the decoded prompt ids,
    where the server returned them) and writes each as ``{out_dir}/{name}.json`` if given."""
    records: dict[str, dict[str, Any]] = {}
    for name, request in cases.items():
        if "get" in request:
            status, response = server.get(request["get"])
        else:
            status, response = server.chat(request)
        record: dict[str, Any] = {"request": dict(request), "status": status, "response": response}
        prompt_ids = returned_prompt_ids(response)
        if prompt_ids is not None:
            record["prompt_text"] = tokenizer.decode(prompt_ids)
        records[name] = record
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for name, record in records.items():
            text = json.dumps(record, indent=1, ensure_ascii=False) + "\n"
            (out / f"{name}.json").write_text(text, encoding="utf-8")
    return records


def load_recorded(directory: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """The committed recordings of ``directory``, name -> record."""
    return {
        p.stem: json.loads(p.read_text(encoding="utf-8"))
        for p in sorted(Path(directory).glob("*.json"))
    }


def json_shape(value: Any) -> Any:
    """The keys, types and nesting of a JSON value, without its values: objects keep their
    keys (sorted), a list becomes the sorted distinct shapes of its items."""
    if isinstance(value, dict):
        return {k: json_shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        shapes = {json.dumps(json_shape(v), sort_keys=True) for v in value}
        return [json.loads(s) for s in sorted(shapes)]
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    return type(value).__name__


def assert_shapes_as_recorded(
    records: Mapping[str, Mapping[str, Any]], directory: str | os.PathLike[str], what: str
) -> None:
    """Fresh ``records`` have the statuses and response shapes of the committed ones."""
    committed = load_recorded(directory)
    assert committed.keys() == records.keys(), f"re-record {directory} ({what})"
    for name, record in records.items():
        assert json_shape(record["response"]) == json_shape(committed[name]["response"]), name
        assert record["status"] == committed[name]["status"], name


def rerecord(
    description: str,
    default_out: Path,
    record: Callable[[Path, Path], None],
    argv: Sequence[str] | None = None,
) -> int:
    """A module's re-recording command line: ``record(model_dir, tmp)`` starts a server
    on a fresh tiny Qwen3 (made in ``tmp`` by the caller) and records into ``--out``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", default=str(default_out))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        record(Path(args.out), Path(tmp))
    print(f"recorded into {args.out}")
    return 0


# --------------------------------------------------------------------------- the workflow


def server_workflow(
    tmp_path: Path,
    model_dir: Path,
    server: ChatServer,
    datasets: dict[str, dict[str, Any]],
    name: str = "wf",
    *,
    chat_template_kwargs: dict[str, Any],
    **generation: Any,
) -> Workflow:
    """A workflow copy whose generate rule uses ``server`` (``backend: openai``)."""
    settings: dict[str, Any] = {
        "backend": "openai",
        "endpoints": [server.url],
        "served_model": server.model_name,
        "request_timeout_s": 600,
    }
    settings.update(generation)
    return new_workflow(
        tmp_path,
        model_dir,
        datasets,
        name,
        model={"chat_template_kwargs": chat_template_kwargs},
        generation=settings,
    )


def job_log(wf: Workflow, dataset: str) -> str:
    return wf.path(f"logs/generate/{dataset}.log").read_text(encoding="utf-8")


@contextlib.contextmanager
def server_log_on_failure(server: ChatServer, offset: int, label: str) -> Iterator[None]:
    """An assertion that fails inside gets what the server logged since ``offset``."""
    try:
        yield
    except AssertionError as exc:
        tail = server.log_text(offset)[-6000:]
        raise AssertionError(f"{exc}\n--- {label} log ({server.log_path}) ---\n{tail}") from None


def tool_prompts() -> list[dict[str, Any]]:
    """Three ``messages`` records offering :data:`WEATHER_TOOL`: a question alone, a
    history with one call and its result, and one with two calls and their results."""

    def call(cid: str, city: str) -> dict[str, Any]:
        arguments = json.dumps({"city": city})
        return {
            "id": cid,
            "type": "function",
            "function": {"name": "get_weather", "arguments": arguments},
        }

    def result(cid: str, text: str) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": cid, "name": "get_weather", "content": text}

    ask = {"role": "user", "content": "What is the weather in Paris?"}
    return [
        {"id": "t0", "messages": [ask], "tools": [WEATHER_TOOL]},
        {
            "id": "t1",
            "messages": [
                ask,
                {"role": "assistant", "content": "", "tool_calls": [call("src_1", "Paris")]},
                result("src_1", "sunny"),
                {"role": "assistant", "content": "It is sunny."},
            ],
            "tools": [WEATHER_TOOL],
        },
        {
            "id": "t2",  # the source called twice; the regenerated turn calls once
            "messages": [
                ask,
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [call("src_a", "Paris"), call("src_b", "Berlin")],
                },
                result("src_a", "sunny"),
                result("src_b", "rainy"),
                {"role": "assistant", "content": "Sunny and rainy."},
            ],
            "tools": [WEATHER_TOOL],
        },
    ]


def tool_workflow(tmp_path: Path, model_dir: Path, server: ChatServer, tokenizer: Any) -> Workflow:
    """Dataset T1 = :func:`tool_prompts`, thinking off, the call forced
    (:func:`forced_tool_call_body`), 3 in flight."""
    prompts = tmp_path / "T1.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in tool_prompts()), encoding="utf-8")
    return server_workflow(
        tmp_path,
        model_dir,
        server,
        {"T1": {"path": str(prompts), "format": "messages"}},
        chat_template_kwargs={"enable_thinking": False},
        concurrency=3,
        sampling={"temperature": 0.0, "max_tokens": 128},
        extra_body=forced_tool_call_body(tokenizer),
    )


def check_tool_rows(wf: Workflow, call_id_prefix: str) -> dict[str, dict[str, Any]]:
    """The rows of a :func:`tool_workflow` run, by id, checked: each regenerated turn is
    one parsed call of :data:`WEATHER_TOOL` (an id of the server's form), the source's tool
    result of t1 relinked to the regenerated call, t2's two results (one regenerated call)
    left as given and not refused."""
    rows = {row["id"]: row for row in wf.responses("T1")}
    assert rows.keys() == {"t0", "t1", "t2"}
    assert wf.path("results/responses/T1.errors.jsonl").read_text() == ""
    for row in rows.values():
        assert row["tools"] == [WEATHER_TOOL]
        answers = [m for m in row["messages"] if m["role"] == "assistant"]
        assert len(answers) == len(row["turns"]) == {"t0": 1, "t1": 2, "t2": 2}[row["id"]]
        for answer, turn in zip(answers, row["turns"], strict=True):
            [call] = answer["tool_calls"]  # parallel_tool_calls: false
            assert answer["content"] == "" and call["type"] == "function"
            assert call["id"].startswith(call_id_prefix), call["id"]
            assert call["function"]["name"] == "get_weather"
            assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Berlin")
            assert turn["finish_reason"] == "tool_calls" and turn["completion_tokens"] > 0
            assert "usage_source" not in turn
    _, first, tool, second = rows["t1"]["messages"]
    assert tool == {
        "role": "tool",
        "tool_call_id": first["tool_calls"][0]["id"],  # relinked to the regenerated call
        "name": "get_weather",
        "content": "sunny",
    }
    assert second["tool_calls"][0]["id"] != first["tool_calls"][0]["id"]  # random ids
    # One regenerated call, two source results: as given, and not refused.
    results = [m for m in rows["t2"]["messages"] if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in results] == ["src_a", "src_b"]
    return rows


# --------------------------------------------------------------------------- the scenarios
# What both servers' suites run, each with its own checks of the server's side.

BUDGET_PROMPTS = 8  # sent at once; the budget is 2.5 answers


def budget_workflow(
    tmp_path: Path,
    model_dir: Path,
    server: ChatServer,
    max_tokens: int,
    extra_body: Mapping[str, Any] | None = None,
) -> tuple[Workflow, list[str]]:
    """Dataset A1 of :data:`BUDGET_PROMPTS` one-turn prompts, all in flight at once,
    thinking on, every answer exactly ``max_tokens`` (``ignore_eos``) and a budget of 2.5
    answers; returns the workflow and the prompts' ids in the seeded order."""
    questions = [
        {"id": f"c{i}", "conversations": [{"from": "human", "value": f"Story {i}, please."}]}
        for i in range(BUDGET_PROMPTS)
    ]
    prompts = write_prompts(tmp_path / "A1.jsonl", questions)
    order = [c.id for c in seeded_order(read_prompts(prompts, "sharegpt").conversations, 0)]
    budget = int(2.5 * max_tokens)
    wf = server_workflow(
        tmp_path,
        model_dir,
        server,
        {"A1": {"path": str(prompts), "format": "sharegpt", "token_budget": budget}},
        chat_template_kwargs={"enable_thinking": True},
        concurrency=BUDGET_PROMPTS,
        sampling={"temperature": 0.0, "max_tokens": max_tokens},
        extra_body={"ignore_eos": True, **(extra_body or {})},  # the lengths: the plan fixed
    )
    return wf, order


def check_budget_run(
    wf: Workflow, order: list[str], max_tokens: int
) -> tuple[list[dict[str, Any]], int, int]:
    """A :func:`budget_workflow` run: the first two answers fit and the third decided the
    prefix; each is the server's reasoning, apart, counted by the server's usage; what was
    journaled beyond them is waste and the rest was cancelled in flight. Returns (the
    rows, how many were journaled, how many cancelled)."""
    rows, stats = wf.responses("A1"), wf.stats("A1")
    journaled = len(wf.journal_lines("A1"))
    seen = f"rows {[row['id'] for row in rows]} of {order}, journaled {journaled}, stats {stats}"
    assert [row["id"] for row in rows] == order[:2], seen
    assert (stats["stop_reason"], stats["completion_tokens"]) == (
        "token_budget",
        2 * max_tokens,
    ), seen
    for row in rows:
        user, answer = row["messages"]
        assert user["role"] == "user" and answer["role"] == "assistant"
        # The parser's split: reasoning apart, no think tag in either field.
        assert answer["reasoning_content"] and "<think>" not in answer["reasoning_content"]
        assert "</think>" not in answer["content"] + answer["reasoning_content"]
        [turn] = row["turns"]
        assert (turn["finish_reason"], turn["completion_tokens"]) == ("length", max_tokens)
        assert "usage_source" not in turn  # the server's usage, reasoning included
        assert row["usage"]["completion_tokens"] == max_tokens
    # (The servers run the requests in arrival order, which is nearly dispatch order: the
    # third answer is normally among the first they run.)
    assert 3 <= journaled < BUDGET_PROMPTS, seen
    # What the cancelled requests had decoded (abandoned records) is generated and wasted.
    abandoned = stats["abandoned_tokens"]
    assert stats["generated_tokens_total"] == journaled * max_tokens + abandoned, seen
    assert stats["waste_tokens"] == (journaled - 2) * max_tokens + abandoned, seen
    log = job_log(wf, "A1")
    [cancelled] = re.findall(r"A1: cancelled (\d+) requests in flight", log) or [None]
    assert cancelled is not None and int(cancelled) == BUDGET_PROMPTS - journaled, (
        f"{seen}\n{log[-3000:]}"
    )
    assert stats["abandoned_requests"] == int(cancelled), seen
    return rows, journaled, int(cancelled)


RESUME_PROMPTS = 10
RESUME_TARGET = "results/responses/A1.jsonl"


def resume_workflows(
    tmp_path: Path, model_dir: Path, server: ChatServer, max_tokens: int
) -> tuple[Workflow, Workflow]:
    """Dataset A1 of :data:`RESUME_PROMPTS` ShareGPT prompts (multi-turn ones among them),
    thinking off, 2 in flight, ``max_tokens`` each: a reference workflow, already run to
    its end, and a fresh one to kill."""
    prompts = write_prompts(tmp_path / "A1.jsonl", sharegpt_prompts(RESUME_PROMPTS))
    datasets = {"A1": {"path": str(prompts), "format": "sharegpt"}}
    options: dict[str, Any] = {
        "chat_template_kwargs": {"enable_thinking": False},
        "concurrency": 2,
        "sampling": {"temperature": 0.0, "max_tokens": max_tokens},
        "extra_body": {"ignore_eos": True},
    }
    reference = server_workflow(tmp_path, model_dir, server, datasets, "reference", **options)
    reference.run(RESUME_TARGET)
    return reference, server_workflow(tmp_path, model_dir, server, datasets, "killed", **options)


def kill_mid_run(wf: Workflow, in_flight: Callable[[], bool]) -> list[str]:
    """Start the A1 run, SIGKILL its whole process group once 3 conversations are
    journaled and ``in_flight()`` (a request is on the server); returns the journal then.
    Nothing partial was declared."""
    proc = wf.start(RESUME_TARGET)
    deadline = time.monotonic() + 300
    while len(wf.journal_lines("A1")) < 3 or not in_flight():
        assert proc.poll() is None, "generation finished before it could be killed"
        assert time.monotonic() < deadline, "no progress in 300 s"
        time.sleep(0.05)
    assert kill_group(proc, signal.SIGKILL) != 0
    partial = wf.journal_lines("A1")
    assert len(partial) < RESUME_PROMPTS, "killed before the end"
    assert not wf.path(RESUME_TARGET).exists(), "no partial declared output"
    return partial


def resume_killed_run(wf: Workflow, partial: list[str], reference: Workflow) -> None:
    """``--unlock`` and the same command: the output equals the uninterrupted run's."""
    wf.run("--unlock")
    wf.run(RESUME_TARGET)
    wf.assert_resumed("A1", partial, reference)
    assert wf.stats("A1")["in_output"] == RESUME_PROMPTS
