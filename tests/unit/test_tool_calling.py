"""Tool calling end to end in-process: tools and tool turns through regeneration (driver,
both engines) and through chat rendering and loss masks, on real tool-calling templates.

Templates: Qwen3-8B's published template (tools in the system block, arguments rendered
as given), a Llama-3.1-style one that writes ``arguments | tojson`` (needs the arguments
as an object), and Kimi-K2.5's (drops a finished tool-call chain's reasoning from history).
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import support.chat_tokenizers as fx
from aiohttp import web
from support.fake_openai import FakeOpenAIServer
from support.fakes import FakeFactory, make_prompt
from support.target_models import KIMI_K25_CHAT_TEMPLATE

from eagle3data.chat import (
    ChatTemplateError,
    render,
    tokenize_conversation,
    training_samples,
)
from eagle3data.generation.driver import GenerationJob, Prompt, run_generation
from eagle3data.generation.engines import Completion, TurnFailure
from eagle3data.generation.engines.openai_engine import HttpSettings, OpenAIEngine
from eagle3data.servers.openai_chat import parse_tool_calls, request_body

QWEN3_TOOLS_TEMPLATE = fx.QWEN3_TEMPLATE  # the published template, tool branches included

# The shape of Llama-3.1's tool branches: tools as JSON in the system block, each call
# written as {"name": ..., "parameters": <arguments | tojson>}, results as ipython turns.
LLAMA31_TOOLS_TEMPLATE = r"""{{- bos_token }}
{%- if tools %}
    {{- '<|start_header_id|>system<|end_header_id|>\n\nYou may call these functions:\n' }}
    {%- for t in tools %}{{- t | tojson }}{{- '\n' }}{%- endfor %}
    {{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'assistant' and message.tool_calls is defined %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {%- for tool_call in message.tool_calls %}
            {{- '{"name": "' + tool_call.function.name + '", "parameters": ' }}
            {{- tool_call.function.arguments | tojson }}
            {{- '}' }}
        {%- endfor %}
        {{- '<|eot_id|>' }}
    {%- elif message.role == 'tool' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}"""  # noqa: E501

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
ARGUMENTS = '{"city": "Paris"}'
RESULT = "Sunny, 21 C"
QUESTION = "What is the weather in Paris?"
ANSWER = "It is sunny in Paris."


def call(call_id: str = "call_1", arguments: str = ARGUMENTS) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }


def tool_conversation(*, reasoning: bool = True) -> list[dict[str, Any]]:
    """user -> assistant calling a tool -> tool result -> assistant answering."""
    calling: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [call()]}
    answering: dict[str, Any] = {"role": "assistant", "content": ANSWER}
    if reasoning:
        calling["reasoning_content"] = "Need a lookup."
        answering["reasoning_content"] = "The tool says sunny."
    return [
        {"role": "user", "content": QUESTION},
        calling,
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": RESULT},
        answering,
    ]


def qwen3_tools() -> Any:
    return fx.make_tokenizer(QWEN3_TOOLS_TEMPLATE, "qwen3")


def llama31_tools() -> Any:
    return fx.make_tokenizer(LLAMA31_TOOLS_TEMPLATE, "llama3")


def kimi_k25() -> Any:
    """Kimi-K2.5's template on a fast stand-in tokenizer (the masks need only offsets)."""
    return fx.make_tokenizer(KIMI_K25_CHAT_TEMPLATE, "qwen3")


def supervised(tokenizer: Any, ids: Sequence[int], mask: Sequence[int]) -> list[str]:
    """Decoded text of each maximal run of supervised tokens."""
    runs: list[list[int]] = []
    previous = 0
    for token, bit in zip(ids, mask, strict=True):
        if bit and not previous:
            runs.append([])
        if bit:
            runs[-1].append(token)
        previous = bit
    return [tokenizer.decode(run, skip_special_tokens=False) for run in runs]


# --------------------------------------------------------------------------- rendering


def test_tools_reach_the_template() -> None:
    tok = qwen3_tools()
    messages = tool_conversation()[:1]
    with_tools = render(tok, messages, add_generation_prompt=True, tools=TOOLS)
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in with_tools
    assert "<tools>" not in render(tok, messages, add_generation_prompt=True)
    # An empty list is no tools, as servers treat it.
    assert render(tok, messages, add_generation_prompt=True, tools=[]) == render(
        tok, messages, add_generation_prompt=True
    )
    (sample,) = training_samples(tok, tool_conversation(), tools=TOOLS)
    assert json.dumps(TOOLS[0]) in sample.text


def test_arguments_reach_the_template_as_the_object_they_encode() -> None:
    tok = llama31_tools()
    messages = tool_conversation(reasoning=False)
    original = copy.deepcopy(messages)
    text = render(tok, messages, add_generation_prompt=False, tools=TOOLS)
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in text
    assert messages == original  # the caller's messages are not modified
    # Arguments that encode no object reach the template as the string they are.
    for arguments in ("not json", "[1, 2]"):
        messages[1]["tool_calls"] = [call(arguments=arguments)]
        text = render(tok, messages, add_generation_prompt=False, tools=TOOLS)
        assert '"parameters": ' + json.dumps(arguments) + "}" in text


def test_qwen3_supervises_the_tool_call_turn_and_not_the_tool_result() -> None:
    tok = qwen3_tools()
    messages = tool_conversation()
    (sample,) = tokenize_conversation(tok, messages, tools=TOOLS)
    assert sample.turn is None  # Qwen3 keeps reasoning after the last user query
    text = render(tok, messages, add_generation_prompt=False, tools=TOOLS)
    assert sample.input_ids == tok.encode(text, add_special_tokens=False)
    calling = (
        '<think>\nNeed a lookup.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
    )
    answering = f"<think>\nThe tool says sunny.\n</think>\n\n{ANSWER}<|im_end|>\n"
    assert supervised(tok, sample.input_ids, sample.loss_mask) == [calling, answering]
    # The tool result is rendered (as a user turn) but never supervised.
    assert f"<|im_start|>user\n<tool_response>\n{RESULT}\n</tool_response><|im_end|>\n" in text


def test_a_run_of_tool_results_is_prompt_and_the_answer_after_it_is_supervised() -> None:
    tok = qwen3_tools()
    messages = tool_conversation()
    messages[1]["tool_calls"] = [call("call_1"), call("call_2", '{"city": "Lyon"}')]
    messages.insert(3, {"role": "tool", "tool_call_id": "call_2", "content": "Rainy"})
    (sample,) = tokenize_conversation(tok, messages, tools=TOOLS)
    runs = supervised(tok, sample.input_ids, sample.loss_mask)
    assert len(runs) == 2
    assert runs[0].count("<tool_call>") == 2 and runs[0].endswith("</tool_call><|im_end|>\n")
    assert runs[1].endswith(f"{ANSWER}<|im_end|>\n")
    assert not any(RESULT in run or "Rainy" in run for run in runs)


def test_llama31_style_template_masks_the_call_and_ids_equal_the_encoding() -> None:
    tok = llama31_tools()
    messages = tool_conversation(reasoning=False)
    (sample,) = tokenize_conversation(tok, messages, tools=TOOLS)
    text = render(tok, messages, add_generation_prompt=False, tools=TOOLS)
    assert sample.input_ids == tok.encode(text, add_special_tokens=False)
    assert supervised(tok, sample.input_ids, sample.loss_mask) == [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
        f"{ANSWER}<|eot_id|>",
    ]


def test_kimi_keeps_one_sample_per_turn_each_as_the_target_saw_it() -> None:
    """Kimi-K2.5 drops a finished chain's reasoning from history: every assistant turn
    becomes its own sample, and the answer's prompt still shows the chain's reasoning."""
    tok = kimi_k25()
    messages = tool_conversation()
    samples = training_samples(tok, messages, tools=TOOLS)
    assert [s.turn for s in samples] == [1, 3]
    calling, answering = samples
    for sample, i in ((calling, 1), (answering, 3)):
        prompt = render(tok, messages[:i], add_generation_prompt=True, tools=TOOLS)
        assert sample.text.startswith(prompt)
        assert sample.spans == [(len(prompt), len(sample.text))]
    assert calling.text[calling.spans[0][0] :] == (
        "Need a lookup.</think><|tool_calls_section_begin|><|tool_call_begin|>call_1"
        f"<|tool_call_argument_begin|>{ARGUMENTS}<|tool_call_end|>"
        "<|tool_calls_section_end|><|im_end|>"
    )
    assert (
        answering.text[answering.spans[0][0] :] == f"The tool says sunny.</think>{ANSWER}<|im_end|>"
    )
    # What the target was shown when it answered: the chain with its reasoning and result.
    shown = answering.text[: answering.spans[0][0]]
    assert "<think>Need a lookup.</think>" in shown and f"## Return of call_1\n{RESULT}" in shown
    assert "tool_declare" in shown  # the tools
    tokenized = tokenize_conversation(tok, messages, tools=TOOLS)
    assert [t.turn for t in tokenized] == [1, 3]
    for sample, tok_sample in zip(samples, tokenized, strict=True):
        assert tok_sample.input_ids == tok.encode(sample.text, add_special_tokens=False)
        runs = supervised(tok, tok_sample.input_ids, tok_sample.loss_mask)
        assert "".join(runs) == sample.text[sample.spans[0][0] :]


def test_kimi_without_reasoning_is_one_sample_with_every_turn_supervised() -> None:
    tok = kimi_k25()
    (sample,) = tokenize_conversation(tok, tool_conversation(), tools=TOOLS, reasoning="drop")
    runs = supervised(tok, sample.input_ids, sample.loss_mask)
    assert runs[0].startswith("</think><|tool_calls_section_begin|>")
    assert runs[1] == f"</think>{ANSWER}<|im_end|>"
    assert not any(RESULT in run for run in runs)


@pytest.mark.parametrize(
    ("messages", "pattern"),
    [
        (
            [{"role": "user", "content": "q"}, {"role": "tool", "content": "x"}],
            "expected a assistant",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "", "tool_calls": [call()]},
                {"role": "tool", "content": RESULT},
                {"role": "user", "content": "again"},
            ],
            r"turn 3: expected a tool or assistant message, got user",
        ),
        (
            [{"role": "user", "content": "q", "tool_calls": [call()]}],
            r"turn 0 \(user\): tool_calls must be",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "", "tool_calls": "x"},
            ],
            r"turn 1 \(assistant\): tool_calls must be",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "", "tool_calls": [call()]},
                {"role": "tool", "content": RESULT, "tool_call_id": 7},
            ],
            r"turn 2 \(tool\): tool_call_id must be a string",
        ),
    ],
)
def test_malformed_tool_conversations_are_named(messages, pattern) -> None:
    with pytest.raises(ChatTemplateError, match=pattern):
        tokenize_conversation(qwen3_tools(), messages, tools=TOOLS)


# --------------------------------------------------------------------------- the driver

SAMPLING = {"max_tokens": 32, "temperature": 0.0}


def source_prompt(pid: str = "t1") -> Prompt:
    """system, user, a call answered by two results, the answer, a follow-up and its answer;
    the source's assistant turns differ from anything the fake engine says."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [call("src_1"), call("src_2", '{"city": "Lyon"}')],
        },
        {"role": "tool", "tool_call_id": "src_1", "name": "get_weather", "content": RESULT},
        {"role": "tool", "tool_call_id": "src_2", "name": "get_weather", "content": "Rainy"},
        {"role": "assistant", "content": "source answer"},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "content": "source follow-up"},
    ]
    return Prompt(pid, f"hash-{pid}", messages, copy.deepcopy(TOOLS))


def reply(conversation: Sequence[dict[str, Any]], tools: Any) -> Completion:
    """Calls the tool when asked a question with tools offered, else answers what it saw."""
    last = conversation[-1]
    if last["role"] == "user" and tools:
        n = sum(m["role"] == "assistant" for m in conversation) + 1
        return Completion(
            content="",
            finish_reason="tool_calls",
            prompt_tokens=len(conversation),
            completion_tokens=7,
            tool_calls=[call(f"regen_{n}")],
        )
    return Completion(
        content=f"answer to {last['content']}",
        finish_reason="stop",
        prompt_tokens=len(conversation),
        completion_tokens=5,
    )


class ToolEngine:
    """An in-process fake engine that takes tools (one entry per conversation)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def complete(self, conversations, *, seed, tools=None) -> list[Completion | TurnFailure]:
        snapshot = copy.deepcopy([list(c) for c in conversations])
        self.calls.append({"seed": seed, "conversations": snapshot, "tools": tools})
        offered = tools if tools is not None else [None] * len(snapshot)
        return [reply(c, t) for c, t in zip(snapshot, offered, strict=True)]


class AsyncToolEngine:
    """The same answers as an HTTP-style engine."""

    capacity = 4

    def __init__(self) -> None:
        self.requests: list[tuple[list[dict[str, Any]], Any]] = []

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def complete(self, messages, tools=None) -> Completion | TurnFailure:
        self.requests.append((copy.deepcopy(list(messages)), tools))
        return reply(messages, tools)


def job(tmp_path: Path, prompts: list[Prompt]) -> GenerationJob:
    return GenerationJob(
        dataset="T1",
        prompts=prompts,
        journal=tmp_path / "journal.jsonl",
        model="m",
        sampling=SAMPLING,
        batch_size=4,
        progress_interval_s=0,
    )


def expected_messages() -> list[dict[str, Any]]:
    src = source_prompt().messages
    regen_1 = {"role": "assistant", "content": "", "tool_calls": [call("regen_1")]}
    regen_2 = {"role": "assistant", "content": "answer to Rainy"}
    regen_3 = {"role": "assistant", "content": "", "tool_calls": [call("regen_3")]}
    return [src[0], src[1], regen_1, src[3], src[4], regen_2, src[6], regen_3]


def test_every_assistant_turn_is_regenerated_on_the_regenerated_history(tmp_path: Path) -> None:
    engine = ToolEngine()
    plain = make_prompt("p1", [{"role": "user", "content": "hello"}])
    result = run_generation(job(tmp_path, [source_prompt(), plain]), lambda: engine)
    tool_row, plain_row = result.rows
    final = expected_messages()
    # One request per source assistant turn, each on the history before it.
    asked = [c for call_ in engine.calls for c in call_["conversations"]]
    assert [c for c in asked if c[0]["role"] == "system"] == [final[:2], final[:5], final[:7]]
    # Tools go with every request of the conversation that has them, and only with it.
    assert all(call_["tools"] is not None for call_ in engine.calls)
    assert engine.calls[0]["tools"] == [TOOLS, None]
    assert tool_row["messages"] == final
    assert tool_row["tools"] == TOOLS
    assert [t["finish_reason"] for t in tool_row["turns"]] == ["tool_calls", "stop", "tool_calls"]
    assert result.stats["truncated"] == 0  # a tool call is an ordinary finish
    assert "tools" not in plain_row
    assert plain_row["messages"] == [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "answer to hello"},
    ]
    journal = [json.loads(line) for line in (tmp_path / "journal.jsonl").read_text().splitlines()]
    assert {r["id"]: "tools" in r for r in journal} == {"t1": True, "p1": False}


def test_the_streaming_driver_sends_the_same_requests(tmp_path: Path) -> None:
    engine = AsyncToolEngine()
    result = run_generation(job(tmp_path, [source_prompt()]), lambda: engine, streaming=True)
    final = expected_messages()
    assert engine.requests == [(final[:2], TOOLS), (final[:5], TOOLS), (final[:7], TOOLS)]
    assert result.rows[0]["messages"] == final and result.rows[0]["tools"] == TOOLS


def test_plain_conversations_make_the_calls_they_always_made(tmp_path: Path) -> None:
    """Engines that know nothing of tools still work: no ``tools=`` for plain batches."""
    factory = FakeFactory()
    prompts = [make_prompt(f"p{i}", [{"role": "user", "content": f"q{i}"}]) for i in range(3)]
    result = run_generation(job(tmp_path, prompts), factory)
    assert len(result.rows) == 3 and all("tools" not in r for r in result.rows)
    assert all(set(m) == {"role", "content"} for r in result.rows for m in r["messages"])


def test_a_tool_conversation_regenerated_twice_tokenizes_with_its_tools(tmp_path: Path) -> None:
    """The response row feeds tokenize: tools rendered, calls supervised, results not."""
    result = run_generation(job(tmp_path, [source_prompt()]), lambda: ToolEngine())
    row = json.loads(json.dumps(result.rows[0]))  # as tokenize reads it back
    tok = qwen3_tools()
    samples = tokenize_conversation(tok, row["messages"], tools=row.get("tools"))
    text = "".join(tok.decode(s.input_ids, skip_special_tokens=False) for s in samples)
    assert "<tools>" in text
    runs = [r for s in samples for r in supervised(tok, s.input_ids, s.loss_mask)]
    assert any('"arguments": {"city": "Paris"}' in r for r in runs)
    assert not any("<tool_response>" in r or RESULT in r for r in runs)


# --------------------------------------------------------------------------- openai engine

HTTP_SAMPLING = {
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": -1,
    "max_tokens": 64,
    "repetition_penalty": 1.0,
    "stop": [],
}


def body_for(messages: list[dict[str, Any]], tools: Any = None) -> dict[str, Any]:
    return request_body(
        messages,
        model="m",
        sampling=HTTP_SAMPLING,
        seed=3,
        chat_template_kwargs={},
        extra_body={},
        tools=tools,
    )


def test_request_body_carries_tools_and_history_in_wire_format() -> None:
    messages = tool_conversation()[:3]
    messages[1]["note"] = "not for the server"
    body = body_for(messages, TOOLS)
    assert body["tools"] == TOOLS
    assert body["messages"] == [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": "",  # rendered as "" by SGLang and vLLM too, and by tokenize
            "reasoning_content": "Need a lookup.",
            "tool_calls": [call()],
        },
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": RESULT},
    ]


def test_a_plain_request_body_is_unchanged() -> None:
    body = body_for([{"role": "user", "content": "hi"}])
    assert body == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 64,
        "temperature": 0.0,
        "top_p": 1.0,
        "seed": 3,
        "stream": False,
    }
    assert body_for([{"role": "user", "content": "hi"}], []) == body


def test_tool_calls_are_parsed_into_the_normalised_form() -> None:
    raw = [
        {
            "id": "call_9",
            "index": 0,
            "type": "function",
            "function": {"name": "get_weather", "arguments": ARGUMENTS},
        },
        {"id": None, "function": {"name": "now", "arguments": None}},
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
    ]
    assert parse_tool_calls(raw) == [
        call("call_9"),
        {"id": "", "type": "function", "function": {"name": "now", "arguments": "{}"}},
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
    ]
    assert parse_tool_calls(None) is None and parse_tool_calls([]) is None
    for bad in ("x", [{"function": {}}], [3]):
        with pytest.raises(ValueError):
            parse_tool_calls(bad)


class ToolServer(FakeOpenAIServer):
    """The fake server, answering a question with a tool call when tools are offered, with
    content null as OpenAI's API sends it (SGLang 0.5.23 sends "": the fake's own
    call_tools and tests/data/sglang/chat_tool_call.json), finish_reason "tool_calls"."""

    def __init__(self, *, usage: bool = True, **options: Any) -> None:
        super().__init__(**options)
        self.with_usage = usage

    async def _complete(self, body, messages, *, usage):
        if not body.get("tools") or messages[-1]["role"] != "user":
            return await super()._complete(body, messages, usage=usage and self.with_usage)
        n = sum(m["role"] == "assistant" for m in messages) + 1
        message = {
            "role": "assistant",
            "content": None,
            "reasoning_content": None,
            "tool_calls": [{**call(f"call_{n}"), "index": 0}],
        }
        reply: dict[str, Any] = {
            "id": f"chatcmpl-tool-{n}",
            "object": "chat.completion",
            "model": body.get("model"),
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
        }
        if self.with_usage:
            reply["usage"] = {"prompt_tokens": 11, "completion_tokens": 13, "total_tokens": 24}
        return web.json_response(reply)


def http_engine(url: str, **kw: Any) -> OpenAIEngine:
    return OpenAIEngine(
        HttpSettings(endpoints=[url], model="fake-model", request_timeout_s=5, max_retries=0),
        sampling=HTTP_SAMPLING,
        seed=0,
        count_tokens=lambda text: len(text),
        **kw,
    )


def test_the_openai_engine_regenerates_tool_calls_through_a_server(tmp_path: Path) -> None:
    prompt = Prompt(
        "t1",
        "h",
        tool_conversation(reasoning=False),
        copy.deepcopy(TOOLS),
    )
    with ToolServer() as server:
        result = run_generation(
            job(tmp_path, [prompt]), lambda: http_engine(server.url), streaming=True
        )
        bodies = server.requests
    row = result.rows[0]
    assert row["tools"] == TOOLS
    assert [b["tools"] for b in bodies] == [TOOLS, TOOLS]
    assert row["messages"][1] == {"role": "assistant", "content": "", "tool_calls": [call()]}
    # The second request carries the regenerated call and the source's result as given.
    assert bodies[1]["messages"][1:] == [row["messages"][1], tool_conversation()[2]]
    assert row["turns"][0] == {
        "finish_reason": "tool_calls",
        "prompt_tokens": 11,
        "completion_tokens": 13,
        "token_ids": None,  # this server sends none
    }
    assert row["usage"]["completion_tokens"] == 13 + row["turns"][1]["completion_tokens"]
    assert result.stats["truncated"] == 0 and result.stats["failed"] == 0


def test_a_usage_less_tool_call_is_counted_with_its_arguments() -> None:
    async def ask(url: str) -> Completion | TurnFailure:
        engine = http_engine(url)
        await engine.start()
        try:
            return await engine.complete([{"role": "user", "content": QUESTION}], TOOLS)
        finally:
            await engine.close()

    with ToolServer(usage=False) as server:
        completion = asyncio.run(ask(server.url))
    assert isinstance(completion, Completion)
    assert completion.tool_calls == [call("call_1")]
    assert completion.usage_source == "tokenizer"
    assert completion.completion_tokens == len("get_weather" + ARGUMENTS)


# --------------------------------------------------------------------------- transformers


@pytest.fixture(scope="module")
def qwen3_tools_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama carrying Qwen3's tool-calling template."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("qwen3-tools")
    tokenizer = qwen3_tools()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_the_transformers_engine_renders_tools_and_keeps_the_raw_output(
    qwen3_tools_model: Path,
) -> None:
    from eagle3data.generation.engines.transformers_engine import TransformersEngine

    sampling = {"max_tokens": 4, "temperature": 0.0, "stop": [], "repetition_penalty": 1.0}
    engine = TransformersEngine(str(qwen3_tools_model), sampling=sampling, device="cpu")
    tok = engine.tokenizer
    conversation = [{"role": "user", "content": QUESTION}]
    with_tools, plain = engine.complete([conversation, conversation], seed=0, tools=[TOOLS, None])
    assert isinstance(with_tools, Completion) and isinstance(plain, Completion)
    prompt = render(tok, conversation, add_generation_prompt=True, tools=TOOLS)
    assert with_tools.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False))
    assert plain.prompt_tokens < with_tools.prompt_tokens
    assert with_tools.tool_calls is None  # not parsed: the markup stays in the content
    # Tool conversations keep special tokens in the text (Kimi's call markup is special).
    body = tok.encode("<|im_start|>call", add_special_tokens=False)
    assert engine._completion(body, [0] * 10, 64, keep_special=True).content == "<|im_start|>call"
    assert engine._completion(body, [0] * 10, 64).content == "call"
