"""The journal record: what the driver writes, and the same counts read with polars
from a journal of any size."""

from __future__ import annotations

import json

import pytest

from eagle3data.atomic import dumps_line
from eagle3data.generation.records import (
    SUMMARY_SCHEMA,
    abandoned_record,
    counted_tokens,
    failed_record,
    is_outcome,
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


def test_an_abandoned_record_is_waste_and_never_an_outcome() -> None:
    server = abandoned_record("p4", "h4", 37, estimated=False)
    guess = abandoned_record("p5", "h5", 12, estimated=True)
    assert not is_outcome(server) and is_outcome(failed_record("p2", "h2", "x", 4))
    assert (counted_tokens(server), spent_tokens(server)) == (0, 37)
    ok = ok_record("p1", "h1", MESSAGES, TURNS)
    summary = summarise([server, guess, ok])
    assert summary["abandoned"].to_list() == [True, True, False]
    assert summary["failed"].to_list() == [False, False, False]
    assert summary["completion_tokens"].to_list() == [0, 0, counted_tokens(ok)]
    assert summary["spent_tokens"].to_list() == [37, 12, spent_tokens(ok)]
    assert summary["spent_estimated"].to_list() == [0, 12, 0]
    assert summary["conversation_tokens"].to_list()[:2] == [0, 0]


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


def test_token_ids_are_stored_once_and_read_back_per_turn() -> None:
    from eagle3data.turn_ids import compact_token_ids, turn_token_ids

    first = ([1, 2, 3], [4, 5])
    second = ([1, 2, 3, 4, 5, 6, 7], [8])  # extends the first turn: stored as [6, 7]
    third = ([1, 2, 9], [10])  # the server rendered history otherwise: shares [1, 2]
    turns: list[dict] = []
    previous: list[int] = []
    for prompt, completion in (first, second, third):
        turns.append({"token_ids": compact_token_ids(previous, prompt, completion)})
        previous = prompt + completion
    assert [t["token_ids"]["prompt"] for t in turns] == [[1, 2, 3], [6, 7], [9]]
    assert [t["token_ids"]["prompt_shared"] for t in turns] == [0, 5, 2]
    assert turn_token_ids(turns) == [first, second, third]
    # A turn without ids (a server that ignored the field) and one after it, stored
    # against nothing; records written before ids were kept have no key at all.
    turns = [
        {"token_ids": compact_token_ids([], *first)},
        {"token_ids": None},
        {"token_ids": compact_token_ids([], *third)},
    ]
    assert turn_token_ids(turns) == [first, None, third]
    assert turn_token_ids(TURNS) == [None, None]
    with pytest.raises(ValueError, match="prompt_shared 9 exceeds"):
        turn_token_ids([{"token_ids": {"prompt_shared": 9, "prompt": [], "completion": []}}])


def test_the_summary_reads_records_with_token_ids_as_without() -> None:
    from eagle3data.turn_ids import compact_token_ids

    with_ids = [
        {**TURNS[0], "token_ids": compact_token_ids([], [1, 2, 3], [4, 5])},
        {**TURNS[1], "token_ids": None},
    ]
    plain = summarise_lines(dumps_line(ok_record("p1", "h1", MESSAGES, TURNS)).encode())
    ids = summarise_lines(dumps_line(ok_record("p1", "h1", MESSAGES, with_ids)).encode())
    assert ids.equals(plain)
