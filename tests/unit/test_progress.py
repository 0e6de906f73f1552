"""The incremental journal summary behind the status command and the dry run."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl

from eagle3data.atomic import dumps_line
from eagle3data.monitor.progress import dataset_progress, journal_summary


def _record(i: int, tokens: int, *, failed: bool = False) -> dict:
    if failed:
        return {"id": f"p{i}", "prompt_hash": "h", "status": "failed", "error": "x",
                "completion_tokens_spent": tokens}  # fmt: skip
    return {
        "id": f"p{i}",
        "prompt_hash": "h",
        "status": "ok",
        "usage": {"prompt_tokens": 10, "completion_tokens": tokens},
        "turns": [{"prompt_tokens": 10, "completion_tokens": tokens}],
        "finished_at": 1000.0 + i,
    }


def test_journal_summary_reads_only_what_was_appended(tmp_path: Path) -> None:
    journal = tmp_path / "gen" / "A1" / "k.jsonl"
    journal.parent.mkdir(parents=True)
    cache = tmp_path / "cache"
    journal.write_text("".join(dumps_line(_record(i, 5 + i)) for i in range(3)))
    first = journal_summary(journal, cache)
    assert first["id"].to_list() == ["p0", "p1", "p2"]
    assert first["conversation_tokens"].to_list() == [15, 16, 17]

    # Appended records (and a torn tail, never summarised) are read from the cached offset.
    with journal.open("a") as fh:
        fh.write(dumps_line(_record(3, 1, failed=True)) + '{"id": "p4", "sta')
    second = journal_summary(journal, cache)
    assert second["id"].to_list() == ["p0", "p1", "p2", "p3"]
    assert second.row(3, named=True)["failed"] and second["spent_tokens"].to_list()[3] == 1
    assert second["completion_tokens"].to_list()[3] == 0
    assert (
        json.loads((cache / "A1-k.json").read_text())["offset"]
        == len(journal.read_bytes().rsplit(b"\n", 1)[0]) + 1
    )

    # A journal restarted from scratch (shorter than the cached offset) is re-read.
    journal.write_text(dumps_line(_record(9, 2)))
    assert journal_summary(journal, cache)["id"].to_list() == ["p9"]


def _abandoned(i: int, tokens: int, source: str = "server") -> dict:
    return {"id": f"p{i}", "prompt_hash": "h", "status": "abandoned",
            "completion_tokens_spent": tokens, "spent_source": source}  # fmt: skip


def test_abandoned_records_are_waste_and_decide_no_prompt(tmp_path: Path) -> None:
    """p1 was cancelled in flight before it finished (abandoned, then ok); p0 had a second
    dispatch cancelled after its ok; p3 was cancelled twice and never finished; p2 failed.
    The prefix is what the outcomes alone give; the generated tokens count every abandoned
    record's decode of the current prompts (not one of an older prompt text)."""
    journal = tmp_path / "gen" / "A1" / "k.jsonl"
    journal.parent.mkdir(parents=True)
    records = [
        _record(0, 10),
        _abandoned(1, 7),
        _record(1, 20),
        _abandoned(0, 2),
        _record(2, 3, failed=True),
        _abandoned(3, 5, "estimate"),
        _abandoned(3, 0),
        {**_abandoned(4, 100), "prompt_hash": "older text"},
    ]
    journal.write_text("".join(dumps_line(r) for r in records))
    order = [f"p{i}" for i in range(5)]
    progress = dataset_progress(
        order,
        ["h"] * 5,
        journal_summary(journal),
        token_budget=100,
        max_samples=None,
        max_seq_len=4096,
    )
    assert progress.selection.selected == [0, 1]  # p2 failed, p3 undecided
    assert (progress.completion_tokens, progress.failed) == (30, 1)
    assert progress.records["id"].to_list() == ["p0", "p1", "p2"]
    assert progress.generated_tokens == 10 + 20 + 3 + 7 + 2 + 5
    assert (progress.abandoned_requests, progress.abandoned_tokens) == (4, 14)
    assert progress.abandoned_tokens_estimated == 5
    # What rates and the throughput picture count: the outcomes, then the abandoned.
    assert progress.journal["id"].to_list() == ["p0", "p1", "p2", "p1", "p0", "p3", "p3"]
    assert int(progress.journal["spent_tokens"].sum()) == progress.generated_tokens


def test_a_summary_cached_in_an_older_layout_is_read_again(tmp_path: Path) -> None:
    journal = tmp_path / "gen" / "A1" / "k.jsonl"
    journal.parent.mkdir(parents=True)
    cache = tmp_path / "cache"
    journal.write_text(dumps_line(_record(0, 5)))
    journal_summary(journal, cache)
    # What an older version cached: the same rows without today's columns.
    table = cache / "A1-k.parquet"
    pl.read_parquet(table).drop("abandoned", "spent_estimated").write_parquet(table)
    with journal.open("a") as fh:
        fh.write(dumps_line(_abandoned(1, 4)))
    summary = journal_summary(journal, cache)
    assert summary["id"].to_list() == ["p0", "p1"]
    assert summary["abandoned"].to_list() == [False, True]


def test_a_record_of_a_kind_this_build_does_not_know_is_named_not_counted(
    tmp_path: Path,
) -> None:
    """The status command, the dry run and the report read the journal through the summary:
    a newer build's record kind is one line naming the file and line (it was counted as an
    ok outcome of 0 tokens), also when it comes after what the cache already read."""
    import pytest

    from eagle3data import __version__
    from eagle3data.errors import JournalCorruptError

    journal = tmp_path / "gen" / "A1" / "k.jsonl"
    journal.parent.mkdir(parents=True)
    cache = tmp_path / "cache"
    journal.write_text("".join(dumps_line(_record(i, 5)) for i in range(2)))
    assert journal_summary(journal, cache).height == 2
    with journal.open("a") as fh:
        fh.write(dumps_line(_record(2, 5)))
        fh.write(dumps_line({"id": "p3", "prompt_hash": "h", "status": "paused"}))
    for cached in (cache, None):
        with pytest.raises(JournalCorruptError) as caught:
            journal_summary(journal, cached)
        message = str(caught.value)
        assert message.startswith(f"{journal}:4: a record of status 'paused'")
        assert f"eagle3data {__version__}" in message and "\n" not in message
