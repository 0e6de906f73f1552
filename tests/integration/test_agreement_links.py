"""The agreement check on the real demo model: each broken link of the data is caught.

SmolLM2-135M-Instruct generates greedily (float32) and its states are captured the way
the pipeline does; then one link is broken on purpose per case and the validate job's
judgement (:mod:`eagle3data.hidden_states.agreement` with the default thresholds) must
fail it, while the intact data passes. A loss mask shifted by one token is invisible to
the agreement (it still selects tokens the target predicts well: measured below) and is
caught by the re-tokenization check instead; wrong aux layers need their own check too.
Properties only: no generated text is asserted.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from eagle3data.chat import tokenize_conversation
from eagle3data.hidden_states import agreement
from eagle3data.hidden_states.validation import retokenize_errors
from eagle3data.shards import ShardWriter, open_shard
from eagle3data.tokenization.settings import TokenizeSettings

PROMPTS = [
    "Name three prime numbers.",
    "What is the capital of France?",
    "Write one sentence about rain.",
]
NEW_TOKENS = 32
# A reasoning the target saw while generating and a broken render drops: it decides what
# the answer is, as a thinking target's reasoning does. The agreement sees the change
# where the answer depends on the missing text (its start): short answers show it best
# (measured: 0.53 on 16-token answers; 0.79 with another prefill on 32-token answers).
REASONING = "The user wants a list of animals instead. Cat, dog, "
REASONING_NEW_TOKENS = 16


@pytest.fixture(scope="module")
def target(smollm2_dir: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return {"dir": smollm2_dir, "tokenizer": tokenizer, "model": model}


def generate(
    target: dict[str, Any], prefill: str = "", new_tokens: int = NEW_TOKENS
) -> list[list[dict[str, str]]]:
    """Greedy conversations; ``prefill`` is written after the generation prompt first."""
    tokenizer, model = target["tokenizer"], target["model"]
    conversations = []
    for prompt in PROMPTS:
        user = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text + prefill, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False)
        answer = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
        conversations.append([*user, {"role": "assistant", "content": answer}])
    return conversations


@pytest.fixture(scope="module")
def greedy(target: dict[str, Any]) -> list[list[dict[str, str]]]:
    return generate(target)


def post_norm(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]


def pre_norm(model: Any, ids: list[int]) -> torch.Tensor:
    captured: dict[str, torch.Tensor] = {}

    def keep(_module: Any, _inputs: Any, output: Any) -> None:
        captured["x"] = output[0] if isinstance(output, tuple) else output

    hook = model.model.layers[-1].register_forward_hook(keep)
    try:
        with torch.no_grad():
            model.model(input_ids=torch.tensor([ids]))
    finally:
        hook.remove()
    return captured["x"][0]


def write_shard(
    path: Path,
    samples: list[tuple[list[int], list[int]]],
    states: Callable[[list[int]], torch.Tensor],
    *,
    rows_shift: int = 0,
    mask_shift: int = 0,
) -> Path:
    hidden = None
    with ShardWriter(path, hidden_size=576, hidden_dtype="float32", attrs={}) as writer:
        for i, (ids, mask) in enumerate(samples):
            last = states(ids)
            hidden = last.shape[1]
            if rows_shift:  # states one row late against the tokens
                last = torch.cat([last[rows_shift:], last[-rows_shift:]])
            if mask_shift:
                mask = ([0] * mask_shift + mask)[: len(mask)]
            writer.add(f"q{i}", ids, mask, torch.zeros(len(ids), 3 * hidden), last)
    return path


def tokenized(tokenizer: Any, conversations: list[list[dict[str, str]]]) -> list[tuple]:
    out = []
    for conversation in conversations:
        (sample,) = tokenize_conversation(tokenizer, conversation)
        out.append((sample.input_ids, sample.loss_mask))
    return out


def judged(target: dict[str, Any], shard_path: Path) -> tuple[dict[str, Any], list[str]]:
    head = agreement.load_head(target["dir"])
    with open_shard(shard_path) as shard:
        stats = agreement.shard_agreement(
            shard, head, agreement.end_of_turn_ids(target["dir"]), None, seed=0
        )
    summary = stats.summary()
    return summary, agreement.judge(summary, greedy=True, settings=agreement.AgreementSettings())


def test_intact_greedy_data_passes(target, greedy, tmp_path):
    samples = tokenized(target["tokenizer"], greedy)
    summary, problems = judged(
        target, write_shard(tmp_path / "ok.h5", samples, target_states(target))
    )
    assert problems == []
    assert summary["agreement"] > 0.9 and summary["control_agreement"] < 0.1


def target_states(target: dict[str, Any]) -> Callable[[list[int]], torch.Tensor]:
    return lambda ids: post_norm(target["model"], ids)


def test_states_one_row_off_fail_and_the_control_shows_it(target, greedy, tmp_path):
    samples = tokenized(target["tokenizer"], greedy)
    path = write_shard(tmp_path / "rows.h5", samples, target_states(target), rows_shift=1)
    summary, problems = judged(target, path)
    assert problems
    # The states now predict the token after next: the control agrees instead.
    assert summary["control_agreement"] > 0.9 > summary["agreement"]


def test_a_pre_norm_final_state_fails(target, greedy, tmp_path):
    samples = tokenized(target["tokenizer"], greedy)
    path = write_shard(tmp_path / "pre.h5", samples, lambda ids: pre_norm(target["model"], ids))
    summary, problems = judged(target, path)
    assert any("min_agreement" in p for p in problems), summary


def test_token_ids_of_another_tokenizer_fail(target, greedy, tmp_path):
    from support.chat_tokenizers import smollm2 as stand_in

    samples = tokenized(stand_in(), greedy)  # same template, another vocabulary
    path = write_shard(tmp_path / "tok.h5", samples, target_states(target))
    summary, problems = judged(target, path)
    assert any("min_agreement" in p for p in problems), summary


def test_states_of_another_model_fail(target, greedy, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    other = AutoModelForCausalLM.from_config(target["model"].config).eval()
    samples = tokenized(target["tokenizer"], greedy)
    path = write_shard(tmp_path / "other.h5", samples, lambda ids: post_norm(other, ids))
    summary, problems = judged(target, path)
    assert len(problems) == 2, summary  # below min_agreement and not above the control


def test_reasoning_dropped_from_the_render_fails(target, tmp_path):
    # The target answered after REASONING; the rendered sample lacks it.
    seen = generate(target, prefill=REASONING, new_tokens=REASONING_NEW_TOKENS)
    samples = tokenized(target["tokenizer"], seen)
    path = write_shard(tmp_path / "dropped.h5", samples, target_states(target))
    summary, problems = judged(target, path)
    assert any("min_agreement" in p for p in problems), summary


def test_a_shifted_mask_is_invisible_to_the_agreement_but_not_to_retokenizing(
    target, greedy, tmp_path
):
    import json

    samples = tokenized(target["tokenizer"], greedy)
    path = write_shard(tmp_path / "mask.h5", samples, target_states(target), mask_shift=1)
    summary, problems = judged(target, path)
    assert problems == [] and summary["agreement"] > 0.9  # why a second check is needed
    responses = tmp_path / "responses.jsonl"
    responses.write_text(
        "".join(json.dumps({"id": f"q{i}", "messages": m}) + "\n" for i, m in enumerate(greedy))
    )

    def retokenized(shard: Path) -> list[str]:
        return retokenize_errors(
            str(responses),
            [str(shard)],
            model_path=str(target["dir"]),
            tokenize=TokenizeSettings(chat_template_kwargs={}, max_seq_len=4096, reasoning="keep"),
            trust_remote_code=False,
            count=len(greedy),
        )

    errors = retokenized(path)
    assert len(errors) == len(greedy)
    assert all("shifted by +1 token(s)" in e and "mask.h5" in e for e in errors)
    assert retokenized(write_shard(tmp_path / "ok.h5", samples, target_states(target))) == []


def test_sampled_data_is_judged_by_log_probability(target, greedy, tmp_path):
    samples = tokenized(target["tokenizer"], greedy)
    ok = write_shard(tmp_path / "ok.h5", samples, target_states(target))
    summary, _ = judged(target, ok)
    settings = agreement.AgreementSettings()
    assert agreement.judge(summary, greedy=False, settings=settings) == []
    other = write_shard(tmp_path / "shift.h5", samples, target_states(target), rows_shift=1)
    summary, _ = judged(target, other)
    problems = agreement.judge(summary, greedy=False, settings=settings)
    assert any("min_logprob_margin" in p for p in problems)
    assert np.isfinite(summary["mean_logprob"])
