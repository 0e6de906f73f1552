"""The validator checks the shards' loss masks against the response rows themselves, not
against a second run of the code that made them (hidden_states.validation): a
mask-placement bug in tokenize_response is caught, correct data passes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch
from support.engine_ids import engine_token_ids

from eagle3data import model_config
from eagle3data.errors import ValidationError
from eagle3data.generation.records import compact_token_ids
from eagle3data.hidden_states import agreement
from eagle3data.hidden_states.layers import resolve_aux_layers
from eagle3data.hidden_states.validation import validate
from eagle3data.shards import ShardWriter
from eagle3data.tokenization import samples as samples_module
from eagle3data.tokenization.samples import ResponseSamples
from eagle3data.tokenization.stage import tokenize

SETTINGS = {"chat_template_kwargs": {}, "max_seq_len": 4096, "reasoning": "keep"}


def conversation(k: int, turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"Question {k}.{t}?"})
        messages.append({"role": "assistant", "content": f"Answer {k}.{t} is {k * t}."})
    return messages


def response(tokenizer: Any, k: int, *, ids: bool = True, split_turn: int = -1) -> dict:
    """A response row as the driver writes it; its ids what a server would return, turn
    ``split_turn`` a non-canonical completion (the next turn's history breaks there)."""
    messages = conversation(k, 3)
    turns: list[dict[str, Any]] = []
    previous: list[int] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        turn: dict[str, Any] = {"finish_reason": "stop", "completion_tokens": 0}
        if ids:
            split = len(turns) == split_turn
            prompt, completion = engine_token_ids(tokenizer, messages[:i], m, split=split)
            turn["token_ids"] = compact_token_ids(previous, prompt, completion)
            previous = prompt + completion
        turns.append(turn)
    return {"id": f"q{k}", "index": k, "messages": messages, "turns": turns}


def dataset(
    tmp_path: Path, model_dir: Path, rows: list[dict], max_seq_len: int = 4096
) -> dict[str, Any]:
    """Tokenize ``rows`` with the stage and write them into one shard (zero states: the
    agreement check is off here), with its plan; the validate() arguments."""
    responses = tmp_path / "A1.jsonl"
    responses.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenized, stats = tmp_path / "A1.parquet", tmp_path / "A1.stats.json"
    settings = {**SETTINGS, "max_seq_len": max_seq_len}
    tokenize(
        dataset="A1",
        responses_path=str(responses),
        model_path=str(model_dir),
        trust_remote_code=False,
        out_tokenized=str(tokenized),
        out_stats=str(stats),
        **settings,
    )
    depth = model_config.num_hidden_layers(model_config.read_model_config(model_dir))
    attrs = resolve_aux_layers("auto", depth, "layer_output").as_attrs()
    shard = tmp_path / "A1_00000.h5"
    frame = pl.read_parquet(tokenized)
    with ShardWriter(shard, hidden_size=4, hidden_dtype="float32", attrs=attrs) as writer:
        for r in frame.iter_rows(named=True):
            n = r["num_tokens"]
            writer.add(
                r["id"], r["input_ids"], r["loss_mask"], torch.zeros(n, 12), torch.zeros(n, 4)
            )
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"shards": [{"start": 0, "end": frame.height}], "hidden_size": 4}))
    return {
        "dataset": "A1",
        "responses_path": str(responses),
        "tokenized_path": str(tokenized),
        "tokenize_stats_path": str(stats),
        "plan_path": str(plan),
        "shard_paths": [str(shard)],
        "out_manifest": str(tmp_path / "manifest.json"),
        "model_path": str(model_dir),
        "agreement_settings": {"enabled": False},
        "tokenize": settings,
        "retokenize_samples": 32,
    }


def shifted_by_one(mask: list[int]) -> list[int]:
    return [0, *mask[:-1]]


def last_token_of_each_turn_unmasked(mask: list[int]) -> list[int]:
    return [m if k + 1 < len(mask) and mask[k + 1] else 0 for k, m in enumerate(mask)]


def with_mask_bug(monkeypatch: pytest.MonkeyPatch, bug: Callable[[list[int]], list[int]]) -> None:
    """tokenize_response places every sample's mask wrongly, for the stage and for any
    check that makes the samples again with it."""
    real = samples_module.tokenize_response

    def buggy(*args: Any, **kwargs: Any) -> ResponseSamples:
        made = real(*args, **kwargs)
        for sample in made.samples:
            sample.loss_mask[:] = bug(list(sample.loss_mask))
        return made

    monkeypatch.setattr(samples_module, "tokenize_response", buggy)


def rows_of(tokenizer: Any) -> list[dict]:
    return [
        response(tokenizer, 0),  # one sample from the engine's ids
        response(tokenizer, 1, split_turn=1),  # two: a break at the third turn
        response(tokenizer, 2, ids=False),  # re-rendered: a row written before ids
    ]


def test_correct_data_passes(tmp_path: Path, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    validate(**dataset(tmp_path, tiny_model_dir, rows_of(tok)))
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["num_samples"] == 4
    assert any("completion ids the response row stores" in c for c in manifest["checks"])


@pytest.mark.parametrize("bug", [shifted_by_one, last_token_of_each_turn_unmasked])
def test_a_mask_placement_bug_in_tokenize_response_is_caught(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, bug: Callable
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    with_mask_bug(monkeypatch, bug)
    with pytest.raises(ValidationError) as caught:
        validate(**dataset(tmp_path, tiny_model_dir, rows_of(tok)))
    message = str(caught.value)
    # Each engine-id sample is named with its response line, in one line each.
    for sample_id, line in [("q0", 1), ("q1#2", 2), ("q1#6", 2)]:
        named = [e for e in message.splitlines() if f"sample {sample_id!r}" in e]
        assert any(f"A1.jsonl:{line}" in e and "completion ids" in e for e in named), message
    if bug is shifted_by_one:  # the re-rendered row's first answer token is left out
        assert "sample 'q2'" in message and "assistant turn" in message


def test_samples_cut_at_max_seq_len_or_dropped_pass(tmp_path: Path, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = rows_of(tok)
    # Up to just before q1's third turn: that turn's sample (q1#6) has nothing left to
    # learn and is dropped, the whole conversations are cut inside their third turn.
    third = rows[1]["messages"][:6]
    prompt, _ = engine_token_ids(tok, third, rows[1]["messages"][6])
    args = dataset(tmp_path, tiny_model_dir, rows, max_seq_len=len(prompt) - 1)
    validate(**args)
    stats = json.loads(Path(args["tokenize_stats_path"]).read_text())
    assert [d["id"] for d in stats["dropped"]] == ["q1#6"]
    assert stats["truncated"] == 2  # q0 and q2


def test_ids_that_do_not_decode_to_the_rows_text_are_caught(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    args = dataset(tmp_path, tiny_model_dir, [response(tok, 0)])
    # The row's text edited after generation: its ids no longer say what it says.
    row = json.loads(Path(args["responses_path"]).read_text())
    row["messages"][4]["content"] = "Something else entirely."
    Path(args["responses_path"]).write_text(json.dumps(row) + "\n")
    named = r"'q0' .*A1\.jsonl:1\): turn 4: .*do not decode to its content .*Something else"
    with pytest.raises(ValidationError, match=named):
        validate(**args)


def test_template_tails_match_the_turns_of_a_sample_from_its_first_turn() -> None:
    # Sample "r#3" trains the turns at message indices 3 and 5; turn 5 was cut at
    # max_tokens 1 and closed by the template with two tokens.
    mask = np.array([0, 1, 1, 0, 1, 1, 1])
    turns = {
        "r": [
            agreement.TurnRecord(1, 2, truncated=False),
            agreement.TurnRecord(3, 2, truncated=False),
            agreement.TurnRecord(5, 1, truncated=True),
        ]
    }
    tails = agreement.template_tails(mask, np.array([0, 7]), ["r#3"], turns)
    assert np.flatnonzero(tails).tolist() == [5, 6]
