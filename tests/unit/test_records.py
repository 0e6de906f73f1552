"""The journal record: what the driver writes, and the same counts read with polars
from a journal of any size."""

from __future__ import annotations

import json

import pytest

from eagle3data.atomic import dumps_line
from eagle3data.generation.records import (
    SUMMARY_SCHEMA,
    counted_tokens,
    failed_record,
    ok_record,
    spent_tokens,
    summarise,
    summarise_lines,
)

TURNS = [
    {"finish_reason": "stop", "prompt_tokens": 10, "completion_tokens": 4},
    {"finish_reason": "length", "prompt_tokens": 20, "completion_tokens": 8},
]
MESSAGES = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


def test_an_ok_record_is_the_journal_line_it_always_was() -> None:
    record = ok_record("p1", "h1", MESSAGES, TURNS)
    assert json.loads(dumps_line(record)) == {
        "id": "p1",
        "prompt_hash": "h1",
        "status": "ok",
        "messages": MESSAGES,
        "finish_reason": "length",  # the last turn's
        "usage": {"prompt_tokens": 30, "completion_tokens": 12},
        "turns": TURNS,
    }
    assert counted_tokens(record) == spent_tokens(record) == 12


def test_a_failed_record_counts_nothing_but_spent_tokens() -> None:
    record = failed_record("p2", "h2", "turn 2: HTTP 400: too long", 4)
    assert set(record) == {"id", "prompt_hash", "status", "error", "completion_tokens_spent"}
    assert (counted_tokens(record), spent_tokens(record)) == (0, 4)


@pytest.mark.parametrize("stamped", [True, False])
def test_polars_reads_the_same_counts(stamped: bool) -> None:
    records = [
        ok_record("p1", "h1", MESSAGES, TURNS),
        failed_record("p2", "h2", "x", 4),
        ok_record("p3", "h3", MESSAGES, TURNS[:1]),
    ]
    if stamped:
        for i, rec in enumerate(records):
            rec["finished_at"] = 100.0 + i
    summary = summarise(records)
    assert summary.schema == SUMMARY_SCHEMA
    assert summary["id"].to_list() == ["p1", "p2", "p3"]
    assert summary["failed"].to_list() == [False, True, False]
    assert summary["completion_tokens"].to_list() == [counted_tokens(r) for r in records]
    assert summary["spent_tokens"].to_list() == [spent_tokens(r) for r in records]
    # The full length: the last turn's prompt (the whole history) and its completion.
    assert summary["conversation_tokens"].to_list() == [28, 0, 14]
    stamps = [100.0, 101.0, 102.0] if stamped else [None, None, None]
    assert summary["finished_at"].to_list() == stamps
    assert summarise_lines(b"").height == 0
