"""The prompts stage: streamed ordering, the prompts table round trip, and skip mode
that cannot pass a dataset it could not read."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from eagle3data.prompts import stage
from eagle3data.prompts.sources import PromptFormatError, read_prompts, seeded_order
from eagle3data.prompts.table import iter_prompts, prompt_order


def write_jsonl(path: Path, lines: list[object]) -> Path:
    path.write_text(
        "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines),
        encoding="utf-8",
    )
    return path


def records(n: int) -> list[dict]:
    return [{"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(n)]


def prepare(tmp_path: Path, source: Path, **kwargs) -> tuple[Path, Path]:
    out, skipped = tmp_path / "out" / "A1.parquet", tmp_path / "out" / "A1.skipped.jsonl"
    stage.prepare_prompts(
        dataset="A1",
        source=str(source),
        on_invalid=kwargs.pop("on_invalid", "skip"),
        shuffle_seed=7,
        out_prompts=str(out),
        out_skipped=str(skipped),
        out_images=str(out.with_name("A1.images.parquet")),
        **kwargs,
    )
    return out, skipped


@pytest.mark.parametrize(
    ("chunk_rows", "bits"), [(37, 4), (50, 8)], ids=["remainder-16", "whole-chunks-256"]
)
def test_spilled_and_in_memory_ordering_write_the_same_table(
    tmp_path, monkeypatch, chunk_rows, bits
) -> None:
    source = write_jsonl(tmp_path / "a.jsonl", records(500))
    in_memory, _ = prepare(tmp_path / "one", source)
    monkeypatch.setattr(stage, "CHUNK_ROWS", chunk_rows)
    monkeypatch.setattr(stage, "MIN_BUCKET_BITS", bits)
    spilled, _ = prepare(tmp_path / "two", source)
    assert pl.read_parquet(spilled).equals(pl.read_parquet(in_memory))
    assert not list((tmp_path / "two" / "out").glob(".*spill*"))
    expected = [c.id for c in seeded_order(read_prompts(source).conversations, 7)]
    assert prompt_order(spilled)[0] == expected
    assert pl.read_parquet(spilled)["index"].to_list() == list(range(500))


def test_buckets_grow_with_the_source_up_to_256() -> None:
    mb = 1 << 20
    assert [stage.bucket_bits(n * mb) for n in (0, 100, 512, 1024, 4096, 100_000)] == [
        4, 4, 4, 5, 7, 8,
    ]  # fmt: skip


def test_tool_conversations_round_trip_through_the_table(tmp_path) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "done", "tool_call_id": "c"},
    ]
    source = write_jsonl(
        tmp_path / "a.jsonl", [{"tools": tools, "messages": messages}, *records(1)]
    )
    out, _ = prepare(tmp_path, source)
    rows = {len(r["messages"]): r for r in iter_prompts(out)}
    assert rows[3]["messages"] == messages and rows[3]["tools"] == tools
    assert rows[1]["messages"] == [{"role": "user", "content": "q0"}] and rows[1]["tools"] is None


def test_skipped_records_are_listed_with_file_line_and_record(tmp_path) -> None:
    source = write_jsonl(tmp_path / "a.jsonl", [*records(3), "not json", records(1)[0]])
    _, skipped = prepare(tmp_path, source)
    rows = [json.loads(line) for line in skipped.read_text().splitlines()]
    assert [(r["line"], r["record"], r["reason"].split(":")[0]) for r in rows] == [
        (4, 4, "(line)"),
        (5, 5, "duplicate of line 1"),
    ]


def test_skip_mode_fails_when_too_few_records_are_valid(tmp_path) -> None:
    source = write_jsonl(tmp_path / "a.jsonl", [*records(1), "x", "y", {"prompt": ""}])
    with pytest.raises(PromptFormatError) as info:
        prepare(tmp_path, source)
    message = str(info.value)
    assert "only 1 of 4 records are valid (25%)" in message
    assert "min_valid_share=0.5" in message and "(line) (2)" in message
    assert not (tmp_path / "out" / "A1.parquet").exists()
    prepare(tmp_path, source, min_valid_share=0.25)  # the user can accept it knowingly


@pytest.mark.parametrize("on_invalid", ["error", "skip"])
def test_an_empty_source_fails_in_both_modes(tmp_path, on_invalid) -> None:
    source = write_jsonl(tmp_path / "a.jsonl", [])
    with pytest.raises(PromptFormatError, match="no records found"):
        prepare(tmp_path, source, on_invalid=on_invalid)


def test_ignored_fields_are_warned_with_counts(tmp_path, caplog) -> None:
    lines = [{**r, "persona": "pirate"} for r in records(3)]
    prepare(tmp_path, write_jsonl(tmp_path / "a.jsonl", lines))
    assert "field 'persona' ignored in 3 record(s)" in caplog.text


@pytest.mark.parametrize(
    "content",
    [b"PK\x03\x04" + bytes(range(256)) * 4, b"\xff\xfe\x00garbage\n" * 50],
    ids=["zip", "binary-lines"],
)
def test_skip_mode_on_an_unreadable_dataset_fails(tmp_path, content) -> None:
    source = tmp_path / "a.jsonl"
    source.write_bytes(content)
    with pytest.raises(PromptFormatError) as info:
        prepare(tmp_path, source)
    assert str(info.value).startswith(str(source))
    assert not (tmp_path / "out" / "A1.parquet").exists()
