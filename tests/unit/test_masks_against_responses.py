"""The validator checks the shards' loss masks against the response rows themselves, not
against a second run of the code that made them (hidden_states.validation): a
mask-placement bug in tokenize_response is caught, correct data passes."""

from __future__ import annotations

import dataclasses
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
from eagle3data.hidden_states import agreement
from eagle3data.hidden_states.layers import resolve_aux_layers
from eagle3data.hidden_states.validation import ValidationSettings, validate
from eagle3data.shards import ShardWriter
from eagle3data.tokenization import samples as samples_module
from eagle3data.tokenization.samples import ResponseSamples
from eagle3data.tokenization.settings import TokenizeSettings
from eagle3data.tokenization.stage import tokenize
from eagle3data.turn_ids import compact_token_ids

SETTINGS = TokenizeSettings(chat_template_kwargs={}, max_seq_len=4096, reasoning="keep")


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
    tmp_path: Path,
    model_dir: Path,
    rows: list[dict],
    max_seq_len: int = 4096,
    reasoning: str = "keep",
) -> dict[str, Any]:
    """Tokenize ``rows`` with the stage and write them into one shard (zero states: the
    agreement check is off here), with its plan; the validate() arguments."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    responses = tmp_path / "A1.jsonl"
    responses.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenized, stats = tmp_path / "A1.parquet", tmp_path / "A1.stats.json"
    settings = dataclasses.replace(SETTINGS, max_seq_len=max_seq_len, reasoning=reasoning)
    tokenize(
        dataset="A1",
        responses_path=str(responses),
        model_path=str(model_dir),
        trust_remote_code=False,
        out_tokenized=str(tokenized),
        out_stats=str(stats),
        settings=settings,
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
        "settings": ValidationSettings(
            agreement=agreement.AgreementSettings(enabled=False),
            tokenize=settings,
            retokenize_samples=32,
        ),
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


def one_wider_at_the_start(mask: list[int]) -> list[int]:
    """The token before each supervised run too (the generation prompt's last)."""
    return [1 if m or (k + 1 < len(mask) and mask[k + 1]) else 0 for k, m in enumerate(mask)]


def one_wider_at_the_end(mask: list[int]) -> list[int]:
    """The token after each supervised run too (the next turn's first)."""
    return [1 if m or (k > 0 and mask[k - 1]) else 0 for k, m in enumerate(mask)]


def the_whole_conversation(mask: list[int]) -> list[int]:
    return [1] * len(mask)


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


@pytest.mark.parametrize(
    "bug", [one_wider_at_the_start, one_wider_at_the_end, the_whole_conversation]
)
@pytest.mark.parametrize("reasoning", ["keep", "drop"])
def test_a_mask_wider_than_the_turns_fails_for_re_rendered_rows(
    tmp_path: Path,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    bug: Callable,
    reasoning: str,
) -> None:
    """Rows without the engine's ids (and every row under reasoning: drop) are checked by
    their text: a mask one token too wide at either end, or over everything, fails (the
    text of the turns is still inside it, which is all an older check asked)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [response(tok, 0, ids=False), response(tok, 1, ids=False)]
    validate(**dataset(tmp_path / "good", tiny_model_dir, rows, reasoning=reasoning))
    with_mask_bug(monkeypatch, bug)
    bad = dataset(tmp_path / "bad", tiny_model_dir, rows, reasoning=reasoning)
    with pytest.raises(ValidationError) as caught:
        validate(**bad)
    message = str(caught.value)
    for sample_id, line in [("q0", 1), ("q1", 2)]:
        named = [e for e in message.splitlines() if f"sample {sample_id!r}" in e]
        assert any(f"A1.jsonl:{line}" in e and "assistant turn" in e for e in named), message
    side = {one_wider_at_the_start: "at the start", one_wider_at_the_end: "at the end"}
    if bug in side:
        assert f"wider than the turn's output {side[bug]}" in message, message


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


def test_shards_of_two_captures_in_one_dataset_fail_validation(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The capture fingerprint (hidden_states.fingerprint): a dataset whose shards were
    captured two ways is refused, naming the shard and the fields that differ."""
    from transformers import AutoTokenizer

    from eagle3data.hidden_states import fingerprint
    from eagle3data.shards import open_shard

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    args = dataset(tmp_path, tiny_model_dir, rows_of(tok))
    # The one shard split in two, the second from another engine.
    [path] = args["shard_paths"]
    with open_shard(path) as shard:
        own = ("num_samples", "num_tokens", "compression", "format", "format_version")
        own += ("hidden_dtype", "hidden_encoding", "hidden_size", "storage_dtype")
        attrs = {k: v for k, v in shard.attrs.items() if k not in own}
        samples = [
            (
                shard.sample_ids[i],
                shard.input_ids[shard.sample_offsets[i] : shard.sample_offsets[i + 1]].tolist(),
                shard.loss_mask[shard.sample_offsets[i] : shard.sample_offsets[i + 1]].tolist(),
            )
            for i in range(shard.num_samples)
        ]
    capture = {f: "x" for f in fingerprint.FIELDS}
    halves = [samples[:2], samples[2:]]
    paths = []
    for k, (half, engine) in enumerate(zip(halves, ["vllm 0.32.0", "sglang 0.5.23"], strict=True)):
        paths.append(str(tmp_path / f"A1_{k:05d}.h5"))
        shard_attrs = {
            **attrs,
            fingerprint.ATTR: fingerprint.fingerprint_attr({**capture, "engine": engine}),
        }
        with ShardWriter(paths[-1], hidden_size=4, hidden_dtype="float32", attrs=shard_attrs) as w:
            for sample_id, ids, mask in half:
                w.add(sample_id, ids, mask, torch.zeros(len(ids), 12), torch.zeros(len(ids), 4))
    plan = {"shards": [{"start": 0, "end": 2}, {"start": 2, "end": 4}], "hidden_size": 4}
    Path(args["plan_path"]).write_text(json.dumps(plan))
    args["shard_paths"] = paths
    with pytest.raises(ValidationError) as caught:
        validate(**args)
    message = str(caught.value)
    assert "A1_00001.h5: captured otherwise than" in message, message
    assert "engine: 'vllm 0.32.0' vs 'sglang 0.5.23'" in message, message
