"""Training samples from the engine's token ids (tokenization.samples), and the stage's
count of turns whose re-render differs from them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support import chat_tokenizers as fx
from support.engine_ids import engine_token_ids

from eagle3data.chat import tokenize_conversation
from eagle3data.errors import ResponseError
from eagle3data.tokenization.samples import tokenize_response
from eagle3data.tokenization.settings import TokenizeSettings
from eagle3data.tokenization.stage import tokenize
from eagle3data.turn_ids import compact_token_ids

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "And of Germany?"},
    {"role": "assistant", "content": "Berlin is the capital of Germany."},
]


def row(tokenizer: Any, messages: list[dict], *, ids: bool = True, **engine: Any) -> dict:
    """A response row as the driver writes it, its ids what a server would return."""
    turns: list[dict] = []
    previous: list[int] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        turn: dict[str, Any] = {"finish_reason": "stop", "prompt_tokens": 0, "completion_tokens": 0}
        if ids:
            prompt, completion = engine_token_ids(tokenizer, messages[:i], m, **engine)
            turn["token_ids"] = compact_token_ids(previous, prompt, completion)
            previous = prompt + completion
        turns.append(turn)
    return {"id": "r1", "index": 0, "messages": messages, "turns": turns}


def make(tokenizer: Any, response: dict, **kw: Any):
    settings = {"chat_template_kwargs": {}, "max_seq_len": None, "reasoning": "keep", **kw}
    return tokenize_response(tokenizer, response, **settings)


def completion_positions(tokenizer: Any, messages: list[dict], **engine: Any) -> list[list[int]]:
    out = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            prompt, completion = engine_token_ids(tokenizer, messages[:i], m, **engine)
            out.append(list(range(len(prompt), len(prompt) + len(completion))))
    return out


def test_canonical_ids_make_the_one_sample_the_render_makes_and_supervise_only_them() -> None:
    tok = fx.smollm2()
    made = make(tok, row(tok, CONVERSATION))
    assert made.source == "engine_ids"
    assert (made.turns_identical, made.differences) == (2, [])
    [sample] = made.samples
    assert sample.turn is None
    # The render's ids, less what the template writes after the last end-of-turn token.
    [rendered] = tokenize_conversation(tok, CONVERSATION)
    assert rendered.input_ids[: len(sample.input_ids)] == sample.input_ids
    assert tok.decode(rendered.input_ids[len(sample.input_ids) :]).strip() == ""
    # Exactly the completion ids are supervised: each ends on <|im_end|>, none has "\n".
    supervised = [k for k, m in enumerate(sample.loss_mask) if m]
    assert supervised == [k for turn in completion_positions(tok, CONVERSATION) for k in turn]
    assert tok.decode([sample.input_ids[k] for k in supervised]).count("<|im_end|>") == 2


def test_a_non_canonical_completion_is_trained_as_generated_and_reported() -> None:
    tok = fx.smollm2()
    made = make(tok, row(tok, CONVERSATION, split=True))
    assert made.turns_identical == 0 and len(made.differences) == 2
    first = made.differences[0]
    assert (first.turn, first.part) == (2, "completion")
    assert first.engine != first.rerender and first.engine.replace(" ", "")
    # The server re-tokenizes history canonically, so turn 2's prompt does not extend
    # turn 1's ids: one sample per turn, each exactly the engine's ids.
    assert [s.turn for s in made.samples] == [2, 4]
    for sample, i in zip(made.samples, [2, 4], strict=True):
        m = CONVERSATION[i]
        prompt, completion = engine_token_ids(tok, CONVERSATION[:i], m, split=True)
        assert sample.input_ids == prompt + completion
        assert sample.loss_mask == [0] * len(prompt) + [1] * len(completion)
        assert tok.decode(completion) == m["content"] + "<|im_end|>"


def test_reasoning_the_parser_stripped_of_its_space_is_trained_with_it() -> None:
    tok = fx.qwen3()
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris.", "reasoning_content": "The user asks."},
    ]
    made = make(tok, row(tok, messages, reasoning_space=" "))
    [difference] = made.differences
    assert difference.part == "completion"
    [sample] = made.samples
    supervised = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
    assert tok.decode(supervised).startswith("<think>\n The user asks.")
    # Without the space the re-render is the engine's.
    assert make(tok, row(tok, messages)).turns_identical == 1


def test_rows_without_ids_and_reasoning_drop_take_the_render() -> None:
    tok = fx.qwen3()
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris.", "reasoning_content": "The user asks."},
    ]
    for response, kw in [
        (row(tok, messages, ids=False), {}),  # written before ids were kept
        ({**row(tok, messages), "turns": [{"token_ids": None}]}, {}),  # a server sent none
        (row(tok, messages), {"reasoning": "drop"}),  # not what the target produced
    ]:
        made = make(tok, response, **kw)
        assert made.source == "rerender"
        want = tokenize_conversation(tok, messages, reasoning=kw.get("reasoning", "keep"))
        assert [(s.input_ids, s.loss_mask) for s in made.samples] == [
            (s.input_ids, s.loss_mask) for s in want
        ]
    no_ids = row(tok, messages, ids=False)
    del no_ids["turns"]  # not even turns
    assert make(tok, no_ids).source == "rerender"


def test_samples_from_ids_are_cut_at_max_seq_len() -> None:
    tok = fx.smollm2()
    [whole] = make(tok, row(tok, CONVERSATION)).samples
    [cut] = make(tok, row(tok, CONVERSATION), max_seq_len=10).samples
    assert cut.input_ids == whole.input_ids[:10] and cut.loss_mask == whole.loss_mask[:10]
    assert cut.num_tokens_before_truncation == len(whole.input_ids)


def test_the_stage_counts_and_shows_where_turns_differ(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [
        {**row(tok, CONVERSATION), "id": "same", "index": 0},
        {**row(tok, CONVERSATION, split=True), "id": "split", "index": 1},
        {**row(tok, CONVERSATION, ids=False), "id": "old", "index": 2},
    ]
    responses = tmp_path / "A1.jsonl"
    responses.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stats_path = tmp_path / "A1.stats.json"
    kwargs = {
        "dataset": "A1",
        "model_path": str(tiny_model_dir),
        "settings": TokenizeSettings(chat_template_kwargs={}, max_seq_len=4096, reasoning="keep"),
        "trust_remote_code": False,
        "out_tokenized": str(tmp_path / "A1.parquet"),
        "out_stats": str(stats_path),
    }
    tokenize(responses_path=str(responses), **kwargs)
    ids = json.loads(stats_path.read_text())["token_ids"]
    assert ids["turns_from_engine_ids"] == 4 and ids["turns_from_rerender"] == 2
    assert (ids["identical_to_rerender"], ids["differ_from_rerender"]) == (2, 2)
    assert [(d["id"], d["turn"], d["part"]) for d in ids["differences"]] == [
        ("split", 2, "completion"),
        ("split", 4, "completion"),
    ]
    # A row whose ids do not fit its messages names the file, the line and the row.
    broken = {**rows[0], "turns": rows[0]["turns"][:1]}
    responses.write_text(json.dumps(rows[2]) + "\n" + json.dumps(broken) + "\n")
    with pytest.raises(ResponseError, match=r"A1\.jsonl:2 \(id 'same'\): 1 turns with token ids"):
        tokenize(responses_path=str(responses), **kwargs)


def ten_turn_row(tokenizer: Any, break_after: int) -> tuple[list[dict], dict]:
    """A 10-turn chat whose assistant turn number ``break_after`` (1-based) is a
    non-canonical completion: the server re-tokenizes it canonically as history, so only
    the next turn's prompt does not extend the ids before it."""
    messages: list[dict] = [{"role": "system", "content": "Be brief."}]
    for k in range(1, 11):
        messages.append({"role": "user", "content": f"What is {k} plus {k}?"})
        messages.append({"role": "assistant", "content": f"{k} plus {k} is {2 * k}."})
    turns: list[dict] = []
    previous: list[int] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        split = len(turns) + 1 == break_after
        prompt, completion = engine_token_ids(tokenizer, messages[:i], m, split=split)
        turns.append({"token_ids": compact_token_ids(previous, prompt, completion)})
        previous = prompt + completion
    return messages, {"id": "chat", "index": 0, "messages": messages, "turns": turns}


def test_one_break_in_ten_turns_splits_only_there() -> None:
    tok = fx.smollm2()
    messages, response = ten_turn_row(tok, break_after=6)
    made = make(tok, response)
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    # Turns 1-6 extend each other; turn 7's prompt is the server's canonical history.
    assert [s.turn for s in made.samples] == [assistant[0], assistant[6]]
    ids = [
        engine_token_ids(tok, messages[:i], messages[i], split=k == 5)
        for k, i in enumerate(assistant)
    ]
    for sample, turns in zip(made.samples, [ids[:6], ids[6:]], strict=True):
        last_prompt, last_completion = turns[-1]
        assert sample.input_ids == last_prompt + last_completion
        supervised = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
        assert supervised == [t for _, completion in turns for t in completion]
    # Every turn is trained once, on one copy of its context (about 5.5x per turn before).
    conversation = len(ids[-1][0]) + len(ids[-1][1])
    stored = sum(len(s.input_ids) for s in made.samples)
    assert stored / conversation < 2
