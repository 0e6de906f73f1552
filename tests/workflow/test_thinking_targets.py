"""Thinking targets end to end: Kimi-K2.5 (the target this pipeline exists for) on a
Kimi-shaped model, and Qwen3.

A tiny random DeepSeek-V3 decoder with Kimi's slow remote-code tiktoken tokenizer, its
special tokens at their real ids and the real K2.5 chat template (support.target_models),
as a plain checkpoint and as the multimodal wrapper with a nested ``text_config``; thinking
on and off; the in-process engine and an OpenAI-compatible server that answers with the
reasoning apart and the token ids it generated. Every run goes through the README's
command to validated shards, and is checked against oracles that do not use our chat
module: the Kimi tokenizer's own ``encode`` of the text the target saw and produced, the
engine's ids, and a direct forward of the decoder.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from support.engine_ids import engine_token_ids
from support.target_models import (
    KIMI_END_OF_TURN,
    KIMI_THINK_CLOSE,
    forward_with_pre_norm,
    kimi_text_decoder,
    make_kimi_dir,
    make_qwen3_dir,
)
from support.workflow import Workflow, new_workflow, sharegpt_prompts, write_prompts

from eagle3data.shards import open_shard

PROMPTS = 4  # q0000 is multi-turn with a system prompt, the others single-turn


@pytest.fixture(scope="module")
def kimi_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("kimi")
    return {
        "plain": make_kimi_dir(base / "Kimi-K2.5-tiny"),
        "wrapper": make_kimi_dir(base / "Kimi-K2.5-tiny-wrapper", wrapper=True),
    }


@pytest.fixture(scope="module")
def kimi_tokenizer(kimi_dirs: dict[str, Path]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(kimi_dirs["plain"], trust_remote_code=True)


def kimi_workflow(
    base: Path, model_dir: Path, name: str, *, thinking: bool, server_url: str | None
) -> Workflow:
    prompts = write_prompts(base / f"{name}.jsonl", sharegpt_prompts(PROMPTS))
    generation: dict[str, Any] = {"sampling": {"temperature": 0.0, "max_tokens": 48}}
    if server_url:
        generation.update(backend="openai", endpoints=[server_url], served_model="kimi")
    wf = new_workflow(
        base,
        model_dir,
        {"A1": {"path": str(prompts), "format": "sharegpt"}},
        name,
        model={"trust_remote_code": True, "chat_template_kwargs": {"thinking": thinking}},
        generation=generation,
        hidden_states={"dtype": "float32"},
        validate={"agreement": agreement_settings(thinking, enabled=server_url is None)},
    )
    wf.env["TIKTOKEN_CACHE_DIR"] = str(base / f"{name}-tiktoken-cache")
    return wf


def agreement_settings(thinking: bool, *, enabled: bool) -> dict[str, Any]:
    """The target really generated the tokens only in process (a scripted server is not
    the target); the fixture's head makes its greedy picks decisive (target_models).

    Thinking on needs no lower bar: the samples are the engine's own ids. Re-rendered,
    the fixture agreed at 0.81 only: its winning tokens are " word" tokens, the engine
    strips the reasoning's leading space as SGLang's parsers do, so each turn's first
    reasoning token re-encoded otherwise ("asks" -> "a", "sks") and a random model's
    picks after that change drift (the tokenize stats count those turns as differing)."""
    return {"enabled": enabled}


def expected_samples(tokenizer: Any, response: dict[str, Any], thinking: bool) -> list[dict]:
    """What each sample of a response must be, restated without our chat module:
    (id, the text the target saw, then each produced part supervised)."""
    messages = response["messages"]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    kwargs = {"thinking": thinking}

    def render(conv: list[dict], prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=prompt, **kwargs
        )

    if not thinking:
        # One sample: the conversation as rendered; each turn's content and end-of-turn
        # token after its generation prompt (which ends in the empty <think></think>).
        parts: list[tuple[str, bool]] = []
        done = ""
        for i in turns:
            prompt = render(messages[:i], True)
            produced = messages[i]["content"] + KIMI_END_OF_TURN
            parts += [(prompt[len(done) :], False), (produced, True)]
            done = prompt + produced
        assert done == render(messages, False)
        return [{"id": response["id"], "parts": parts}]
    # Thinking: one sample per assistant turn, the prompt the target saw, then what it
    # wrote after the template's <think>: reasoning, </think>, content, end of turn.
    samples = []
    for i in turns:
        m = messages[i]
        produced = m.get("reasoning_content", "") + KIMI_THINK_CLOSE + m["content"]
        sample_id = response["id"] if len(turns) == 1 else f"{response['id']}#{i}"
        parts = [(render(messages[:i], True), False), (produced + KIMI_END_OF_TURN, True)]
        samples.append({"id": sample_id, "parts": parts})
    return samples


def server_token_ids(tokenizer: Any) -> Any:
    """The fake server's ``token_ids_fn``: ids as a sampled target and a reasoning parser
    make them (support.engine_ids)."""

    def token_ids(body: dict[str, Any], message: dict[str, Any]) -> tuple[list[int], list[int]]:
        return engine_token_ids(
            tokenizer,
            body["messages"],
            message,
            chat_template_kwargs=body.get("chat_template_kwargs"),
            tools=body.get("tools"),
            split=True,
            reasoning_space=" ",
        )

    return token_ids


def check_tokenized(wf: Workflow, tokenizer: Any, thinking: bool) -> pl.DataFrame:
    """Rows with the engine's token ids are trained on those ids; rows without (a server
    that sends none) on the render, as :func:`expected_samples` restates it."""
    tokenized = pl.read_parquet(wf.path("results/tokenized/A1.parquet"))
    expected = []
    for r in wf.responses("A1"):
        if all(t.get("token_ids") for t in r["turns"]):
            expected += samples_from_engine_ids(tokenizer, r, thinking)
        else:
            expected += encoded(tokenizer, expected_samples(tokenizer, r, thinking))
    assert tokenized["id"].to_list() == [s["id"] for s in expected]
    for row, sample in zip(tokenized.iter_rows(named=True), expected, strict=True):
        assert row["input_ids"] == sample["input_ids"]
        assert row["loss_mask"] == sample["loss_mask"]
    return tokenized


def encoded(tokenizer: Any, samples: list[dict]) -> list[dict]:
    """Kimi's own encode (tiktoken, specials allowed) of each sample, part by part and
    whole."""
    out = []
    for sample in samples:
        ids: list[int] = []
        mask: list[int] = []
        for text, supervised in sample["parts"]:
            piece = tokenizer.encode(text)
            ids += piece
            mask += [int(supervised)] * len(piece)
        assert ids == tokenizer.encode("".join(text for text, _ in sample["parts"]))
        out.append({"id": sample["id"], "input_ids": ids, "loss_mask": mask})
    return out


def samples_from_engine_ids(tokenizer: Any, response: dict[str, Any], thinking: bool) -> list[dict]:
    """What the samples of a row with ids must be, restated: each turn's prompt ids are
    Kimi's own encode of the prompt the template renders, its completion ids decode to
    what the row says it produced; a new sample from each turn whose prompt ids do not
    extend the previous turn's ids (one sample when none), the completion ids supervised."""
    messages = response["messages"]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    views = []
    done: list[int] = []
    for i, turn in zip(turns, response["turns"], strict=True):
        ids = turn["token_ids"]
        prompt = done[: ids["prompt_shared"]] + ids["prompt"]
        completion = ids["completion"]
        render = tokenizer.apply_chat_template(
            messages[:i], tokenize=False, add_generation_prompt=True, thinking=thinking
        )
        assert prompt == tokenizer.encode(render)
        m = messages[i]
        close = KIMI_THINK_CLOSE if thinking else ""
        wrote = m.get("reasoning_content", "") + close + m["content"] + KIMI_END_OF_TURN
        # The engine strips the reasoning's whitespace, as SGLang's parsers do; a turn cut
        # at max_tokens wrote only the start of it.
        got, want = "".join(tokenizer.decode(completion).split()), "".join(wrote.split())
        assert got == want if turn["finish_reason"] == "stop" else want.startswith(got)
        views.append((i, prompt, completion))
        done = prompt + completion
    # A turn whose prompt ids do not extend the previous turn's ids starts a new sample.
    runs: list[list[tuple[int, list[int], list[int]]]] = []
    before: list[int] = []
    for view in views:
        if not runs or view[1][: len(before)] != before:
            runs.append([])
        runs[-1].append(view)
        before = view[1] + view[2]
    samples = []
    for run in runs:
        _, prompt, completion = run[-1]
        mask = [0] * (len(prompt) + len(completion))
        for _, p, c in run:
            mask[len(p) : len(p) + len(c)] = [1] * len(c)
        sample_id = response["id"] if len(runs) == 1 else f"{response['id']}#{run[0][0]}"
        samples.append({"id": sample_id, "input_ids": prompt + completion, "loss_mask": mask})
    return samples


def check_states(wf: Workflow, model_dir: Path, tokenized: pl.DataFrame) -> None:
    decoder = kimi_text_decoder(model_dir).float().eval()
    manifest = json.loads(wf.path("results/hidden_states/A1/manifest.json").read_text())
    assert manifest["num_samples"] == tokenized.height
    seen = []
    for entry in manifest["shards"]:
        with open_shard(wf.path(f"results/hidden_states/A1/{entry['file']}")) as shard:
            layers = shard.attrs["aux_layer_ids"]
            assert shard.attrs["reasoning"] == "keep"
            for i in range(shard.num_samples):
                s = shard.sample(i)
                seen.append(s["id"])
                out, pre = forward_with_pre_norm(decoder, [int(t) for t in s["input_ids"]])
                want_aux = torch.cat([out.hidden_states[k + 1][0] for k in layers], -1)
                got_aux = torch.from_numpy(s["aux_hidden_states"])
                got_last = torch.from_numpy(s["last_hidden_states"])
                torch.testing.assert_close(got_aux, want_aux, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(got_last, pre, rtol=1e-4, atol=1e-4)  # pre_norm
    assert seen == tokenized["id"].to_list()


@pytest.fixture(scope="module")
def kimi_runs(
    tmp_path_factory: pytest.TempPathFactory, kimi_dirs: dict[str, Path], kimi_tokenizer: Any
) -> Callable[[str, bool, str], Workflow]:
    """``run(variant, thinking, backend)``: that Kimi-shaped workflow run to the end, made
    once per module: the end-to-end test checks each, and the tests that change a run (the
    ids removed, the agreement turned on) work on a copy of one (``Workflow.copy``)."""
    from support.fake_openai import FakeOpenAIServer

    runs: dict[tuple[str, bool, str], Workflow] = {}

    def run(variant: str, thinking: bool, backend: str) -> Workflow:
        key = (variant, thinking, backend)
        if key in runs:
            return runs[key]
        base = tmp_path_factory.mktemp(f"kimi-{variant}-{int(thinking)}-{backend}")
        model_dir = kimi_dirs[variant]
        if backend == "openai":
            # A server with a reasoning parser (SGLang's kimi_k2: reasoning_content; vLLM's:
            # reasoning; with thinking off there is none) that returns token ids as a
            # sampled target would make them: non-canonical, its reasoning begun with a
            # space the parser strips.
            server = FakeOpenAIServer(
                model="kimi",
                mean_tokens=6,
                reasoning=thinking,
                dialect="sglang" if variant == "plain" else "vllm",
                token_ids_fn=server_token_ids(kimi_tokenizer),
            )
            with server:
                wf = kimi_workflow(base, model_dir, "wf", thinking=thinking, server_url=server.url)
                wf.run()
        else:
            wf = kimi_workflow(base, model_dir, "wf", thinking=thinking, server_url=None)
            wf.run()
        runs[key] = wf
        return wf

    return run


# Each pair of (checkpoint, thinking, backend) values in one of four runs, not all eight: the
# checks below depend on the values two at a time (``split``; the backend's accounting), and
# each run costs about 30 s on the 2-core CI machine. The other tests here copy the first two.
END_TO_END = [
    ("plain", True, "transformers"),
    ("plain", False, "openai"),
    ("wrapper", True, "openai"),
    ("wrapper", False, "transformers"),
]


@pytest.mark.parametrize(
    ("variant", "thinking", "backend"),
    END_TO_END,
    ids=[f"{v}-{'thinking' if t else 'no-thinking'}-{b}" for v, t, b in END_TO_END],
)
def test_kimi_shaped_target_end_to_end(
    kimi_runs: Callable[[str, bool, str], Workflow],
    kimi_dirs: dict[str, Path],
    kimi_tokenizer: Any,
    variant: str,
    thinking: bool,
    backend: str,
) -> None:
    wf = kimi_runs(variant, thinking, backend)
    check_kimi_run(wf, kimi_dirs[variant], kimi_tokenizer, thinking=thinking, backend=backend)


def check_kimi_run(
    wf: Workflow, model_dir: Path, kimi_tokenizer: Any, *, thinking: bool, backend: str
) -> None:
    """A finished Kimi-shaped run against the oracles: the responses split as the servers'
    parsers split them, the samples, the states, the token-id and agreement accounting."""
    responses = wf.responses("A1")
    assert len(responses) == PROMPTS
    for r in responses:
        for m in r["messages"]:
            if m["role"] == "assistant":
                # The engines split reasoning off as the servers' parsers do.
                assert ("reasoning_content" in m) == thinking
                assert KIMI_THINK_CLOSE not in m["content"]
    tokenized = check_tokenized(wf, kimi_tokenizer, thinking)
    stats = json.loads(wf.path("results/tokenized/A1.stats.json").read_text())
    # The server's history is canonical where its completions were not: one sample per turn.
    split = thinking or backend == "openai"
    assert stats["conversations_split_per_turn"] == (1 if split else 0)
    check_states(wf, model_dir, tokenized)
    ids = stats["token_ids"]
    turns = sum(len(r["turns"]) for r in responses)
    assert ids["turns_from_engine_ids"] == turns > PROMPTS  # q0000 is multi-turn
    assert all(d["part"] == "completion" for d in ids["differences"])
    manifest = json.loads(wf.path("results/hidden_states/A1/manifest.json").read_text())
    if backend == "transformers":
        check = manifest["agreement"]
        assert check["greedy"] and check["positions"] > 100
        assert check["agreement"] >= 0.95 > 0.1 >= check["control_agreement"]
        # Thinking on: every turn's reasoning starts with a space the parser stripped, so
        # no turn re-renders as the engine made it; thinking off re-renders identically.
        assert ids["differ_from_rerender"] == (turns if thinking else 0)
    else:
        assert manifest["agreement"] is None  # off: a scripted server is not the target
        assert ids["differ_from_rerender"] == turns  # no completion is canonical
        # The fake's usage counts words, not its ids: counted and logged, not fatal.
        assert wf.stats("A1")["turns_usage_disagrees_with_ids"] == turns
        log = wf.path("logs/generate/A1.log").read_text()
        assert "disagree with usage.completion_tokens" in log


def test_kimi_without_trust_remote_code_stops_with_one_clear_line(
    tmp_path: Path, kimi_dirs: dict[str, Path]
) -> None:
    wf = kimi_workflow(tmp_path, kimi_dirs["plain"], "wf", thinking=True, server_url=None)
    wf.config["model"]["trust_remote_code"] = False
    wf.write_config()
    proc = wf.run(check=False)
    assert proc.returncode != 0
    log = wf.path("logs/generate/A1.log").read_text()
    errors = [line for line in log.splitlines() if "model.trust_remote_code" in line]
    assert len(errors) == 1, log
    assert "tokenizer_config.json auto_map.AutoTokenizer" in errors[0]
    assert "Traceback" not in log
    assert not wf.path("results/responses/A1.jsonl").exists()


def test_responses_the_target_did_not_generate_fail_validation(
    kimi_runs: Callable[[str, bool, str], Workflow], tmp_path: Path
) -> None:
    """A scripted server stands for a server running another model: the shards are sound,
    but the target does not agree with the tokens, and validate says so and why. (The
    plain checkpoint's run against the server, thinking off, with the agreement turned on:
    only validate runs again.)"""
    wf = kimi_runs("plain", False, "openai").copy(tmp_path)
    assert wf.config["generation"]["backend"] == "openai"
    wf.config["validate"] = {"agreement": {"enabled": True}}
    wf.write_config()
    proc = wf.run(check=False)
    assert proc.returncode != 0
    log = wf.path("logs/validate/A1.log").read_text()
    assert "A1: the target does not agree with the tokens it generated" in log
    assert "responses not generated by this model" in log
    assert not wf.path("results/hidden_states/A1/manifest.json").exists()
    assert list(wf.path("results/hidden_states/A1").glob("shard-*.h5"))  # the shards stay


def test_qwen3_thinking_through_a_reasoning_server(tmp_path: Path) -> None:
    """Qwen3 keeps the last turn's reasoning in a full render and drops history's: a
    single-turn conversation is one sample, a multi-turn one a sample per turn."""
    from support.fake_openai import FakeOpenAIServer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = make_qwen3_dir(tmp_path / "Qwen3-tiny")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = write_prompts(tmp_path / "A1.jsonl", sharegpt_prompts(PROMPTS))
    with FakeOpenAIServer(model="qwen3", mean_tokens=6, reasoning=True) as server:
        wf = new_workflow(
            tmp_path,
            model_dir,
            {"A1": {"path": str(prompts), "format": "sharegpt"}},
            generation={"backend": "openai", "endpoints": [server.url], "served_model": "qwen3"},
            hidden_states={"dtype": "float32"},
        )
        wf.run()

    def render(conv: list[dict], prompt: bool) -> str:
        return tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=prompt)

    expected = []
    for r in wf.responses("A1"):
        messages = r["messages"]
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        for i in turns:
            m = messages[i]
            # What Qwen3 wrote after "<|im_start|>assistant\n" (its template's rendering).
            produced = (
                f"<think>\n{m['reasoning_content'].strip()}\n</think>\n\n{m['content']}<|im_end|>\n"
            )
            sample_id = r["id"] if len(turns) == 1 else f"{r['id']}#{i}"
            expected.append((sample_id, render(messages[:i], True), produced))
    tokenized = pl.read_parquet(wf.path("results/tokenized/A1.parquet"))
    assert tokenized["id"].to_list() == [e[0] for e in expected]
    encode = tokenizer.encode
    for row, (_, prompt, produced) in zip(tokenized.iter_rows(named=True), expected, strict=True):
        prompt_ids, produced_ids = encode(prompt), encode(produced)
        assert row["input_ids"] == encode(prompt + produced) == prompt_ids + produced_ids
        assert row["loss_mask"] == [0] * len(prompt_ids) + [1] * len(produced_ids)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    manifest = json.loads(wf.path("results/hidden_states/A1/manifest.json").read_text())
    for entry in manifest["shards"]:
        with open_shard(wf.path(f"results/hidden_states/A1/{entry['file']}")) as shard:
            for i in range(shard.num_samples):
                s = shard.sample(i)
                _, pre = forward_with_pre_norm(model, [int(t) for t in s["input_ids"]])
                got_last = torch.from_numpy(s["last_hidden_states"])
                torch.testing.assert_close(got_last, pre, rtol=1e-4, atol=1e-4)  # pre_norm


def test_rows_without_ids_still_train_and_show_what_the_ids_fix(
    kimi_runs: Callable[[str, bool, str], Workflow], tmp_path: Path
) -> None:
    """The same thinking run tokenized from the engine's ids and, its ids removed as in
    rows written before they were kept, from the re-render: both validate, and only the
    ids reach the agreement of thinking off (docs/reference/validation.md, "Training on the
    engine's token ids" reports both). (The run
    with ids: the plain checkpoint thinking in process, as the end-to-end test checks it.)"""
    wf = kimi_runs("plain", True, "transformers").copy(tmp_path)
    assert wf.config["validate"]["agreement"]["enabled"]
    manifest_path = wf.path("results/hidden_states/A1/manifest.json")
    with_ids = json.loads(manifest_path.read_text())
    responses = wf.path("results/responses/A1.jsonl")
    rows = [json.loads(line) for line in responses.read_text().splitlines()]
    for r in rows:
        for turn in r["turns"]:
            del turn["token_ids"]
    responses.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # What re-rendered data needed to pass before ids were kept (the fixture's 0.81).
    wf.config["validate"]["agreement"]["min_agreement"] = 0.7
    wf.write_config()
    wf.run()
    without = json.loads(manifest_path.read_text())
    assert without["token_ids"]["turns_from_engine_ids"] == 0
    assert without["token_ids"]["turns_from_rerender"] == sum(len(r["turns"]) for r in rows)
    assert with_ids["token_ids"]["turns_from_rerender"] == 0
    after, before = with_ids["agreement"]["agreement"], without["agreement"]["agreement"]
    print(f"\nKimi-shaped, thinking: agreement {before:.4f} re-rendered, {after:.4f} from ids")
    assert after >= 0.95 and before < after - 0.05
