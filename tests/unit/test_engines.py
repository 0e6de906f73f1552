"""engines/ builds the engine generation.backend names, from the generate rule's
settings (what it produces) and the execution settings (how it runs)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from eagle3data.errors import EngineUnavailable
from eagle3data.generation.engines import build_engine, is_streaming
from eagle3data.generation.engines.openai_engine import OpenAIEngine
from eagle3data.generation.engines.transformers_engine import TransformersEngine
from eagle3data.generation.settings import GenerationSettings

SAMPLING = {
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": -1,
    "max_tokens": 8,
    "repetition_penalty": 1.0,
    "stop": [],
}


def config(model: Path | str, **generation: Any) -> dict[str, Any]:
    gen = {
        "backend": "transformers",
        "batch_size": 4,
        "seed": 7,
        "device": "cpu",
        "progress_interval_s": 10,
        "endpoints": [],
        "served_model": None,
        "api_key_env": None,
        "concurrency": 3,
        "request_timeout_s": 60,
        "max_retries": 2,
        "max_consecutive_failures": 20,
        "max_error_rate": 0.5,
        "extra_body": {"min_p": 0.05},
        "return_token_ids": True,
        "sampling": SAMPLING,
        **generation,
    }
    model_cfg = {"path": str(model), "name": "tiny", "dtype": "auto", "trust_remote_code": False}
    return {"model": {**model_cfg, "chat_template_kwargs": {"thinking": True}}, "generation": gen}


def build(cfg: dict[str, Any]) -> Any:
    return build_engine(GenerationSettings.of_config(cfg), threads=1)


def test_the_openai_backend_is_an_http_engine_with_every_setting() -> None:
    cfg = config("m", backend="openai", endpoints=["http://a/v1", "http://b/v1"])
    engine = build(cfg)
    assert isinstance(engine, OpenAIEngine) and is_streaming("openai")
    http = engine.settings
    assert list(http.endpoints) == ["http://a/v1", "http://b/v1"]
    assert (http.model, http.concurrency, http.request_timeout_s) == ("tiny", 3, 60)
    assert (http.max_retries, dict(http.extra_body), http.api_key) == (2, {"min_p": 0.05}, None)
    assert engine.capacity == 6
    assert (engine.seed, engine.sampling, engine.chat_template_kwargs) == (
        7,
        SAMPLING,
        {"thinking": True},
    )


def test_an_api_key_comes_from_the_named_variable_only(monkeypatch) -> None:
    cfg = config("m", backend="openai", endpoints=["http://a/v1"], api_key_env="MY_KEY")
    monkeypatch.delenv("MY_KEY", raising=False)
    with pytest.raises(EngineUnavailable, match="names 'MY_KEY', which is not set"):
        build(cfg)
    monkeypatch.setenv("MY_KEY", "s3cret")
    assert build(cfg).settings.api_key == "s3cret"


def test_the_transformers_backend_is_an_in_process_engine(tiny_model_dir: Path) -> None:
    engine = build(config(tiny_model_dir))
    assert isinstance(engine, TransformersEngine) and not is_streaming("transformers")
    assert engine.sampling == SAMPLING and engine.chat_template_kwargs == {"thinking": True}
    assert engine.context_length == 512  # the tiny model's max_position_embeddings
    assert engine.model.device.type == "cpu"


def test_an_unknown_backend_is_named() -> None:
    with pytest.raises(ValueError, match=r"generation\.backend must be one of"):
        # The schema refuses it first; a settings object made by hand gets this.
        build_engine(dataclasses.replace(GenerationSettings.of_config(config("m")), backend="vllm"))


def test_in_process_engine_splits_reasoning_even_where_think_tags_are_special(
    tmp_path: Path,
) -> None:
    from support.target_models import make_kimi_dir, tiktoken_cache

    with tiktoken_cache(str(tmp_path / "tiktoken")):
        model_dir = make_kimi_dir(tmp_path / "kimi")
        engine = TransformersEngine(
            str(model_dir),
            sampling={"max_tokens": 4, "temperature": 0.0, "stop": [], "repetition_penalty": 1.0},
            trust_remote_code=True,
        )
    tokenizer = engine.tokenizer
    body = tokenizer.encode("Two and two.</think>Four.")
    close = tokenizer.convert_tokens_to_ids("</think>")
    assert close in body and close in tokenizer.all_special_ids  # Kimi marks it special
    assert "</think>" not in tokenizer.decode(body, skip_special_tokens=True)
    completion = engine._completion(body, prompt=[0] * 10, max_new=64)
    prompt = "<|im_assistant|>assistant<|im_middle|><think>"
    split = engine._split(prompt, completion)
    assert (split.reasoning_content, split.content) == ("Two and two.", "Four.")
    assert split.completion_tokens == len(body)
    # A real generation through the same path: a thinking prompt, so all of a completion
    # cut off before </think> is reasoning.
    (result,) = engine.complete([[{"role": "user", "content": "Hi"}]], seed=0)
    assert result.content == "" and result.reasoning_content


def test_in_process_engine_returns_the_ids_it_saw_and_produced(tiny_model_dir: Path) -> None:
    """What the servers' ``return_token_ids`` give: the rendered prompt's ids, then the
    generated ids up to and including the EOS, as many as it counts."""
    from eagle3data.chat import render

    sampling = {"max_tokens": 6, "temperature": 0.0, "stop": [], "repetition_penalty": 1.0}
    engine = TransformersEngine(str(tiny_model_dir), sampling=sampling)
    conversation = [{"role": "user", "content": "Hi"}]
    (result,) = engine.complete([conversation], seed=0)
    prompt = render(engine.tokenizer, conversation, add_generation_prompt=True)
    assert result.prompt_ids == engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert result.completion_ids is not None
    assert len(result.completion_ids) == result.completion_tokens
    ends_on_eos = result.completion_ids[-1] in engine.eos_ids
    assert ends_on_eos == (result.finish_reason == "stop")
    # A finished row's padding is not part of it.
    body = [5, 6, engine.eos_ids[0], engine.eos_ids[0], engine.eos_ids[0]]
    done = engine._completion(body, prompt=[1, 2], max_new=5)
    assert done.completion_ids == [5, 6, engine.eos_ids[0]] and done.prompt_ids == [1, 2]


def test_in_process_engine_marks_a_prompt_longer_than_the_context(tiny_model_dir: Path) -> None:
    """The same kind as a server's context error, so errors.jsonl and the stats count it."""
    from eagle3data.generation.engines import OVER_CONTEXT, TurnFailure

    engine = TransformersEngine(str(tiny_model_dir), sampling=SAMPLING)
    engine.context_length = 16  # a context the chat template alone nearly fills
    long = [{"role": "user", "content": " ".join(["word"] * 40)}]
    (result,) = engine.complete([long], seed=0)
    assert isinstance(result, TurnFailure) and result.kind == OVER_CONTEXT
    assert result.spent_tokens == 0
