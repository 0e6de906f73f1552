"""The incremental journal summary behind the status command and the dry run."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3data.atomic import dumps_line
from eagle3data.monitor.progress import journal_summary


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
