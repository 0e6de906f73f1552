"""The generation driver (order, budget, journal, resume, accounting) with a fake engine."""

from __future__ import annotations

import contextlib
import json
import logging
import random
from pathlib import Path

import pytest
from support.fakes import (
    EngineKilled,
    FakeEngine,
    FakeFactory,
    answer_for,
    make_prompt,
    no_engine,
    single_turn,
    tokens_for,
)

from eagle3data.atomic import dumps_line
from eagle3data.generation.budget import Outcome, select_prefix
from eagle3data.generation.driver import GenerationJob, Prompt, run_generation, write_outputs
from eagle3data.generation.journal import JournalLockedError, JournalWriter, read_journal

SAMPLING = {"max_tokens": 32, "temperature": 0.0}
ROW_FIELDS = {"id", "dataset", "index", "messages", "finish_reason", "usage", "model", "sampling"}


def make_prompts(n: int, tag: str = "q") -> list[Prompt]:
    # Varying lengths so completion tokens (5 + len % 17) vary between 5 and 21.
    return [single_turn(f"{tag}{i:03d}", f"{tag} {i} " + "x" * (i * 7 % 23)) for i in range(n)]


def make_job(tmp_path: Path, prompts, **kw) -> GenerationJob:
    args = {
        "dataset": "B2",
        "prompts": prompts,
        "journal": tmp_path / ".work" / "B2.journal.jsonl",
        "model": "m",
        "sampling": SAMPLING,
        "token_budget": None,
        "max_samples": None,
        "batch_size": 4,
        "progress_interval_s": 0,
    }
    args.update(kw)
    return GenerationJob(**args)


def user_texts(p: Prompt) -> list[str]:
    return [m["content"] for m in p.messages if m["role"] == "user"]


def expected_selection(prompts, *, token_budget=None, max_samples=None, fail=()):
    """The budget prefix computed from what the fake engine would answer."""
    outcomes = {}
    for p in prompts:
        texts = user_texts(p)
        if any(t in fail for t in texts):
            outcomes[p.id] = Outcome(0, failed=True)
        else:
            outcomes[p.id] = Outcome(sum(tokens_for(t) for t in texts))
    return select_prefix(
        [p.id for p in prompts], outcomes, token_budget=token_budget, max_samples=max_samples
    )


def rows_bytes(result) -> bytes:
    return "".join(dumps_line(r) for r in result.rows).encode()


def check_stats(result, job: GenerationJob) -> None:
    s = result.stats
    assert s["prompts"] == len(job.prompts)
    assert s["in_output"] + s["failed"] + s["beyond_limits"] == s["prompts"]
    assert s["in_output"] == len(result.rows)
    assert s["failed"] == len(s["failures"]) == len(result.failures)
    assert s["completion_tokens"] == sum(r["usage"]["completion_tokens"] for r in result.rows)
    assert s["prompt_tokens"] == sum(r["usage"]["prompt_tokens"] for r in result.rows)
    assert s["waste_tokens"] == s["generated_tokens_total"] - s["completion_tokens"]
    assert s["waste_tokens"] >= 0
    if job.token_budget is not None:
        assert s["completion_tokens"] <= job.token_budget
    if job.max_samples is not None:
        assert s["in_output"] <= job.max_samples
    assert s["token_budget"] == job.token_budget
    assert s["max_samples"] == job.max_samples
    assert s["dataset"] == job.dataset
    # rows are in order, distinct, and their index is the position in the order
    order = [p.id for p in job.prompts]
    assert [r["index"] for r in result.rows] == sorted({r["index"] for r in result.rows})
    for r in result.rows:
        assert order[r["index"]] == r["id"]
    # journal total matches the reported generated total for the current prompts
    by_id = {p.id: p.prompt_hash for p in job.prompts}
    seen: set[str] = set()
    total = 0
    for rec in read_journal(job.journal):
        if by_id.get(rec["id"]) == rec["prompt_hash"] and rec["id"] not in seen:
            seen.add(rec["id"])
            total += (
                rec["usage"]["completion_tokens"]
                if rec["status"] == "ok"
                else rec["completion_tokens_spent"]
            )
    assert s["generated_tokens_total"] == total


# --------------------------------------------------------------------------- rows and budget


def test_rows_are_the_budget_prefix_with_design_fields(tmp_path):
    prompts = make_prompts(40)
    job = make_job(tmp_path, prompts, token_budget=150)
    factory = FakeFactory()
    result = run_generation(job, factory)
    want = expected_selection(prompts, token_budget=150)
    assert want.stop_reason == "token_budget"
    assert [r["index"] for r in result.rows] == want.selected
    assert [r["id"] for r in result.rows] == [prompts[i].id for i in want.selected]
    assert result.selection.selected == want.selected
    for row in result.rows:
        assert set(row) >= ROW_FIELDS
        p = prompts[row["index"]]
        (text,) = user_texts(p)
        assert row["dataset"] == "B2"
        assert row["model"] == "m"
        assert {k: row["sampling"][k] for k in SAMPLING} == SAMPLING
        assert row["messages"] == [
            {"role": "user", "content": text},
            {"role": "assistant", "content": answer_for(text)},
        ]
        assert row["finish_reason"] == "stop"
        assert set(row["usage"]) >= {"prompt_tokens", "completion_tokens"}
        assert row["usage"]["completion_tokens"] == tokens_for(text)
        assert row["usage"]["prompt_tokens"] == len(text)
        json.dumps(row)  # serialisable
    total = sum(r["usage"]["completion_tokens"] for r in result.rows)
    assert total == want.tokens <= 150
    # the next prompt would not have fit
    nxt = prompts[len(result.rows)]
    assert total + tokens_for(user_texts(nxt)[0]) > 150
    assert result.stats["stop_reason"] == "token_budget"
    check_stats(result, job)
    assert factory.calls == 1


def test_dispatch_stops_near_the_budget(tmp_path):
    """Only the last batch may run past the prefix: waste is bounded by one batch."""
    prompts = make_prompts(200)
    job = make_job(tmp_path, prompts, token_budget=100, batch_size=4)
    factory = FakeFactory()
    result = run_generation(job, factory)
    asked = len(factory.engine.conversations)
    assert asked == result.generated_now == result.stats["records_generated_now"]
    assert asked <= result.selection.frontier + job.batch_size
    assert asked < 40
    check_stats(result, job)


def test_no_limits_generates_everything(tmp_path):
    prompts = make_prompts(9)
    job = make_job(tmp_path, prompts)
    factory = FakeFactory()
    result = run_generation(job, factory)
    assert [r["id"] for r in result.rows] == [p.id for p in prompts]
    assert result.stats["stop_reason"] == "exhausted"
    assert result.stats["beyond_limits"] == 0
    assert result.stats["waste_tokens"] == 0
    assert sorted(factory.engine.first_user_texts) == sorted(user_texts(p)[0] for p in prompts)
    # batches of at most batch_size
    assert all(len(c["conversations"]) <= 4 for c in factory.engine.calls)
    check_stats(result, job)


def test_max_samples(tmp_path):
    prompts = make_prompts(20)
    job = make_job(tmp_path, prompts, max_samples=7)
    factory = FakeFactory()
    result = run_generation(job, factory)
    assert [r["index"] for r in result.rows] == list(range(7))
    assert result.stats["stop_reason"] == "max_samples"
    assert result.stats["beyond_limits"] == 13
    assert len(factory.engine.conversations) <= 8  # never more than the batches needed
    check_stats(result, job)


def test_both_limits(tmp_path):
    prompts = make_prompts(30)
    for budget, max_samples in [(60, 20), (10_000, 5)]:
        job = make_job(
            tmp_path / f"{budget}", prompts, token_budget=budget, max_samples=max_samples
        )
        result = run_generation(job, FakeFactory())
        want = expected_selection(prompts, token_budget=budget, max_samples=max_samples)
        assert [r["index"] for r in result.rows] == want.selected
        assert result.stats["stop_reason"] == want.stop_reason
        check_stats(result, job)


@pytest.mark.parametrize("limits", [{"token_budget": 0}, {"max_samples": 0}])
def test_zero_limits_need_no_engine(tmp_path, limits):
    prompts = make_prompts(5)
    job = make_job(tmp_path, prompts, **limits)
    result = run_generation(job, no_engine)
    assert result.rows == []
    assert result.stats["beyond_limits"] == 5
    assert result.generated_now == 0
    check_stats(result, job)


def _budget_field(caplog) -> str:
    fields = [w for r in caplog.records for w in r.getMessage().split() if w.startswith("budget=")]
    assert fields, caplog.text
    return fields[-1]


def test_zero_budget_is_not_logged_as_no_budget(tmp_path, caplog):
    """A budget of 0 (nothing allowed) must not read like an absent budget (no cap)."""
    with caplog.at_level(logging.INFO, logger="eagle3data.generation"):
        run_generation(make_job(tmp_path / "zero", make_prompts(3), token_budget=0), no_engine)
    zero = _budget_field(caplog)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="eagle3data.generation"):
        run_generation(make_job(tmp_path / "none", make_prompts(3), max_samples=0), no_engine)
    absent = _budget_field(caplog)
    assert zero != absent, (zero, absent)
    assert "unlimited" not in zero


def test_empty_prompt_list(tmp_path):
    job = make_job(tmp_path, [], token_budget=10)
    result = run_generation(job, no_engine)
    assert result.rows == []
    check_stats(result, job)


def test_system_prompt_is_kept_and_sent(tmp_path):
    prompts = [single_turn("s1", "hello", system="Be terse."), single_turn("s2", "bye")]
    job = make_job(tmp_path, prompts)
    factory = FakeFactory()
    result = run_generation(job, factory)
    assert result.rows[0]["messages"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "answer to hello"},
    ]
    assert [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hello"}] in (
        factory.engine.conversations
    )


def test_reasoning_content_and_length_finish_are_recorded(tmp_path):
    prompts = [single_turn("a", "think"), single_turn("b", "long one")]
    job = make_job(tmp_path, prompts)
    result = run_generation(job, FakeFactory(reasoning=True, length={"long one"}))
    a, b = result.rows
    assert a["messages"][-1] == {
        "role": "assistant",
        "content": "answer to think",
        "reasoning_content": "thinking about think",
    }
    assert a["finish_reason"] == "stop"
    assert b["finish_reason"] == "length"
    assert result.stats["truncated"] == 1
    check_stats(result, job)


# --------------------------------------------------------------------------- multi-turn


def test_multi_turn_regenerates_each_turn_on_regenerated_history(tmp_path):
    source = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "SOURCE ANSWER 1"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "SOURCE ANSWER 2"},
        {"role": "user", "content": "third"},
    ]
    prompts = [make_prompt("mt", source), single_turn("st", "lonely")]
    job = make_job(tmp_path, prompts)
    factory = FakeFactory()
    result = run_generation(job, factory)
    row = next(r for r in result.rows if r["id"] == "mt")
    assert row["messages"] == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "answer to first"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "answer to second"},
        {"role": "user", "content": "third"},
        {"role": "assistant", "content": "answer to third"},
    ]
    assert "SOURCE" not in json.dumps(result.rows)
    mt_asked = [c for c in factory.engine.conversations if c[0]["content"] == "S"]
    assert mt_asked == [
        row["messages"][:2],
        row["messages"][:4],
        row["messages"][:6],
    ]
    assert not any("SOURCE" in json.dumps(c) for c in factory.engine.conversations)
    want_tokens = sum(tokens_for(t) for t in ("first", "second", "third"))
    assert row["usage"]["completion_tokens"] == want_tokens
    check_stats(result, job)


def test_multi_turn_prompt_ending_with_source_assistant_turn(tmp_path):
    source = [
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "SOURCE"},
    ]
    job = make_job(tmp_path, [make_prompt("x", source)])
    result = run_generation(job, FakeFactory())
    assert result.rows[0]["messages"] == [
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "answer to u1"},
    ]


def test_multi_turn_budget_counts_every_turn(tmp_path):
    prompts = [
        make_prompt(
            f"m{i}",
            [
                {"role": "user", "content": f"a{i}"},
                {"role": "assistant", "content": "src"},
                {"role": "user", "content": f"b{i}" + "y" * i},
            ],
        )
        for i in range(20)
    ]
    job = make_job(tmp_path, prompts, token_budget=90)
    result = run_generation(job, FakeFactory())
    want = expected_selection(prompts, token_budget=90)
    assert [r["index"] for r in result.rows] == want.selected
    assert result.stats["completion_tokens"] == want.tokens <= 90
    check_stats(result, job)


# --------------------------------------------------------------------------- failures


def test_failed_prompts_are_skipped_listed_and_counted(tmp_path):
    prompts = make_prompts(12)
    bad = {user_texts(prompts[2])[0], user_texts(prompts[5])[0]}
    job = make_job(tmp_path, prompts, token_budget=80)
    result = run_generation(job, FakeFactory(fail=bad))
    want = expected_selection(prompts, token_budget=80, fail=bad)
    assert 2 in want.failed  # the test is meaningful
    assert [r["index"] for r in result.rows] == want.selected
    assert [f["index"] for f in result.stats["failures"]] == want.failed
    for f in result.stats["failures"]:
        assert f["id"] == prompts[f["index"]].id
        assert "refused" in f["error"]
    assert result.stats["failed"] == len(want.failed)
    check_stats(result, job)


def test_failure_on_a_later_turn_fails_the_conversation_and_counts_its_tokens(tmp_path):
    mt = make_prompt(
        "mt",
        [
            {"role": "user", "content": "ok turn"},
            {"role": "assistant", "content": "src"},
            {"role": "user", "content": "bad turn"},
        ],
    )
    prompts = [single_turn("a", "fine"), mt, single_turn("b", "also fine")]
    job = make_job(tmp_path, prompts)
    result = run_generation(job, FakeFactory(fail={"bad turn"}))
    assert [r["id"] for r in result.rows] == ["a", "b"]
    (failure,) = result.stats["failures"]
    assert failure["id"] == "mt" and failure["index"] == 1
    assert "turn 2" in failure["error"]
    # the successful first turn was generated and is waste
    assert result.stats["waste_tokens"] == tokens_for("ok turn")
    check_stats(result, job)


def test_failed_prompts_are_not_retried_on_rerun(tmp_path):
    prompts = make_prompts(6)
    bad = {user_texts(prompts[1])[0]}
    job = make_job(tmp_path, prompts)
    first = run_generation(job, FakeFactory(fail=bad))
    second = run_generation(job, no_engine)
    assert rows_bytes(first) == rows_bytes(second)
    assert second.stats["failures"] == first.stats["failures"]


# --------------------------------------------------------------------------- kill and resume


def _kill_and_resume(tmp_path, prompts, kill_after, **kw):
    job = make_job(tmp_path, prompts, **kw)
    dying = FakeFactory(raise_after_calls=kill_after)
    with pytest.raises(EngineKilled):
        run_generation(job, dying)
    resumed_factory = FakeFactory()
    resumed = run_generation(job, resumed_factory)
    return job, dying.engine, resumed_factory.engines, resumed


@pytest.mark.parametrize("kill_after", [0, 1, 2, 3, 5])
def test_killed_and_resumed_run_is_byte_identical(tmp_path, kill_after):
    prompts = make_prompts(60)
    kw = {"token_budget": 400, "batch_size": 3}
    ref_factory = FakeFactory()
    ref_job = make_job(tmp_path / "ref", prompts, **kw)
    ref = run_generation(ref_job, ref_factory)
    assert ref.stats["stop_reason"] == "token_budget"
    assert len(ref_factory.engine.calls) > 6  # the kill points fall inside the run

    job, dead, resumed_engines, resumed = _kill_and_resume(
        tmp_path / "run", prompts, kill_after, **kw
    )
    assert rows_bytes(resumed) == rows_bytes(ref)
    write_outputs(ref, tmp_path / "ref.jsonl")
    write_outputs(resumed, tmp_path / "resumed.jsonl")
    assert (tmp_path / "ref.jsonl").read_bytes() == (tmp_path / "resumed.jsonl").read_bytes()

    # no prompt asked twice across both runs, and the same work as the reference overall
    asked = dead.asked_keys + [k for e in resumed_engines for k in e.asked_keys]
    assert len(asked) == len(set(asked))
    assert sorted(asked) == sorted(ref_factory.engine.asked_keys)
    # same batches, hence the same per-batch sampling seeds, as the uninterrupted run
    seeds = dead.seeds_by_conversation()
    for e in resumed_engines:
        seeds |= e.seeds_by_conversation()
    assert seeds == ref_factory.engine.seeds_by_conversation()

    assert resumed.stats["records_resumed"] == len(dead.conversations)
    assert resumed.stats["records_generated_now"] == len(asked) - len(dead.conversations)
    assert resumed.stats["generated_tokens_total"] == ref.stats["generated_tokens_total"]
    check_stats(resumed, job)


def test_killed_multi_turn_run_is_byte_identical(tmp_path):
    prompts = [
        make_prompt(
            f"m{i:02d}",
            [
                {"role": "user", "content": f"first {i}" + "z" * (i % 5)},
                {"role": "assistant", "content": "src"},
                {"role": "user", "content": f"second {i}"},
            ],
        )
        for i in range(30)
    ]
    kw = {"token_budget": 180, "batch_size": 2}
    ref_factory = FakeFactory()
    ref = run_generation(make_job(tmp_path / "ref", prompts, **kw), ref_factory)
    assert len(ref_factory.engine.calls) > 6
    for kill_after in (1, 2, 3, 4, 5):  # odd calls die between the two turns of a batch
        job, _, _, resumed = _kill_and_resume(
            tmp_path / f"k{kill_after}", prompts, kill_after, **kw
        )
        assert rows_bytes(resumed) == rows_bytes(ref), kill_after
        check_stats(resumed, job)


def test_repeated_kills_then_finish(tmp_path):
    prompts = make_prompts(50)
    kw = {"token_budget": 250, "batch_size": 2}
    ref = run_generation(make_job(tmp_path / "ref", prompts, **kw), FakeFactory())
    job = make_job(tmp_path / "run", prompts, **kw)
    asked: list[str] = []
    for _ in range(4):
        f = FakeFactory(raise_after_calls=2)
        with pytest.raises(EngineKilled):
            run_generation(job, f)
        asked += f.engine.asked_keys
    f = FakeFactory()
    result = run_generation(job, f)
    asked += [k for e in f.engines for k in e.asked_keys]
    assert rows_bytes(result) == rows_bytes(ref)
    assert len(asked) == len(set(asked))


def test_resume_counts_journal_tokens_against_the_budget(tmp_path):
    prompts = make_prompts(80)
    budget = 150
    job, dead, resumed_engines, resumed = _kill_and_resume(
        tmp_path, prompts, 3, token_budget=budget, batch_size=2
    )
    journal_tokens = dead.completion_tokens
    assert journal_tokens > 0
    assert resumed.stats["completion_tokens"] <= budget
    want = expected_selection(prompts, token_budget=budget)
    assert [r["index"] for r in resumed.rows] == want.selected
    # the resumed engine was not asked about anything already in the journal
    resumed_first = {t for e in resumed_engines for t in e.first_user_texts}
    assert not resumed_first & set(dead.first_user_texts)
    # and it did not start the budget from zero: it generated only what was missing
    fresh_total = sum(e.completion_tokens for e in resumed_engines)
    assert journal_tokens + fresh_total == resumed.stats["generated_tokens_total"]
    assert resumed.stats["records_resumed"] == len(dead.conversations)
    check_stats(resumed, job)


def test_completed_run_rerun_calls_no_engine_and_is_identical(tmp_path):
    prompts = make_prompts(30)
    job = make_job(tmp_path, prompts, token_budget=120)
    first = run_generation(job, FakeFactory())
    again = run_generation(job, no_engine)
    assert rows_bytes(again) == rows_bytes(first)
    assert again.generated_now == 0
    assert again.stats["records_resumed"] == first.stats["records_generated_now"]
    assert again.stats["generated_tokens_total"] == first.stats["generated_tokens_total"]


def test_journal_locked_by_another_writer(tmp_path):
    prompts = make_prompts(5)
    job = make_job(tmp_path, prompts)
    with JournalWriter(job.journal), pytest.raises(JournalLockedError):
        run_generation(job, FakeFactory())


# --------------------------------------------------------------------------- budget changes


def test_raising_the_budget_generates_only_new_prompts(tmp_path):
    prompts = make_prompts(80)
    job = make_job(tmp_path, prompts, token_budget=100)
    first_factory = FakeFactory()
    first = run_generation(job, first_factory)
    before = set(first_factory.engine.first_user_texts)

    job.token_budget = 300
    second_factory = FakeFactory()
    second = run_generation(job, second_factory)
    now = second_factory.engine.first_user_texts
    assert now, "a higher budget needs more prompts"
    assert not set(now) & before
    assert len(now) == len(set(now))
    # the old rows are a prefix of the new ones, and the result equals a fresh run
    assert second.rows[: len(first.rows)] == first.rows
    fresh = run_generation(make_job(tmp_path / "fresh", prompts, token_budget=300), FakeFactory())
    assert rows_bytes(second) == rows_bytes(fresh)
    assert second.stats["records_resumed"] == len(before)
    check_stats(second, job)


def test_lowering_the_budget_calls_no_engine_and_gives_the_shorter_prefix(tmp_path):
    prompts = make_prompts(60)
    job = make_job(tmp_path, prompts, token_budget=300)
    full = run_generation(job, FakeFactory())
    journal_before = job.journal.read_bytes()
    job.token_budget = 90
    lower = run_generation(job, no_engine)
    want = expected_selection(prompts, token_budget=90)
    assert [r["index"] for r in lower.rows] == want.selected
    assert lower.rows == full.rows[: len(lower.rows)]
    assert len(lower.rows) < len(full.rows)
    assert lower.stats["completion_tokens"] <= 90
    assert lower.stats["generated_tokens_total"] == full.stats["generated_tokens_total"]
    assert job.journal.read_bytes() == journal_before  # untouched
    check_stats(lower, job)


def test_lowering_max_samples_calls_no_engine(tmp_path):
    prompts = make_prompts(20)
    job = make_job(tmp_path, prompts, max_samples=10)
    run_generation(job, FakeFactory())
    job.max_samples = 4
    result = run_generation(job, no_engine)
    assert [r["index"] for r in result.rows] == [0, 1, 2, 3]
    check_stats(result, job)


def test_adding_prompts_reuses_generated_ones(tmp_path):
    # New prompts appear in the order (e.g. the source grew); old records still count.
    old = make_prompts(20)
    new_prompts = make_prompts(20, tag="n")
    job = make_job(tmp_path, old)
    f1 = FakeFactory()
    run_generation(job, f1)
    mixed = [p for pair in zip(old, new_prompts, strict=True) for p in pair]
    job2 = make_job(tmp_path, mixed)
    f2 = FakeFactory()
    result = run_generation(job2, f2)
    assert sorted(f2.engine.first_user_texts) == sorted(user_texts(p)[0] for p in new_prompts)
    assert [r["id"] for r in result.rows] == [p.id for p in mixed]
    check_stats(result, job2)


# --------------------------------------------------------------------------- journal damage


def test_torn_last_journal_line_is_recovered(tmp_path):
    prompts = make_prompts(40)
    ref = run_generation(make_job(tmp_path / "ref", prompts, token_budget=160), FakeFactory())

    job = make_job(tmp_path / "run", prompts, token_budget=160)
    run_generation(job, FakeFactory())
    data = job.journal.read_bytes()
    lines = data.splitlines(keepends=True)
    assert len(lines) >= 3
    # power loss mid-write: the last record is cut in half
    torn = b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2]
    job.journal.write_bytes(torn)
    lost = json.loads(lines[-1])

    f = FakeFactory()
    result = run_generation(job, f)
    assert rows_bytes(result) == rows_bytes(ref)
    lost_text = next(user_texts(p)[0] for p in prompts if p.id == lost["id"])
    if lost["id"] in {r["id"] for r in ref.rows}:
        assert lost_text in f.engine.first_user_texts  # regenerated
    # the journal is whole again: every line is a complete record
    for line in job.journal.read_bytes().splitlines(keepends=True):
        assert line.endswith(b"\n")
        json.loads(line)
    check_stats(result, job)


def test_torn_line_after_a_complete_prefix_is_harmless(tmp_path):
    prompts = make_prompts(30)
    job = make_job(tmp_path, prompts, token_budget=100)
    first = run_generation(job, FakeFactory())
    with open(job.journal, "ab") as fh:
        fh.write(b'{"id":"q099","prompt_hash":"x","sta')
    again = run_generation(job, no_engine)
    assert rows_bytes(again) == rows_bytes(first)
    job.token_budget = 200
    f = FakeFactory()
    more = run_generation(job, f)  # opens the journal for append: repairs the tail
    assert more.stats["completion_tokens"] <= 200
    assert all(line.endswith(b"\n") for line in job.journal.read_bytes().splitlines(True))
    assert [r["index"] for r in more.rows] == expected_selection(prompts, token_budget=200).selected


def test_changed_prompt_text_under_the_same_id_is_regenerated(tmp_path):
    prompts = make_prompts(10)
    job = make_job(tmp_path, prompts)
    run_generation(job, FakeFactory())

    changed = list(prompts)
    changed[3] = single_turn(prompts[3].id, "a completely different question")
    assert changed[3].prompt_hash != prompts[3].prompt_hash
    job2 = make_job(tmp_path, changed)
    f = FakeFactory()
    result = run_generation(job2, f)
    assert f.engine.first_user_texts == ["a completely different question"]
    row = result.rows[3]
    assert row["id"] == prompts[3].id
    assert row["messages"][-1]["content"] == "answer to a completely different question"
    # the stale record is not counted in the output nor in the current generated total
    check_stats(result, job2)
    # a third run sees the new record and needs nothing
    assert rows_bytes(run_generation(job2, no_engine)) == rows_bytes(result)


def test_records_of_unknown_prompts_in_the_journal_are_ignored(tmp_path):
    prompts = make_prompts(5)
    job = make_job(tmp_path, prompts, token_budget=30)
    job.journal.parent.mkdir(parents=True)
    with JournalWriter(job.journal) as j:
        j.append(
            {
                "id": "gone",
                "prompt_hash": "0",
                "status": "ok",
                "messages": [],
                "finish_reason": "stop",
                "usage": {"prompt_tokens": 1, "completion_tokens": 10_000},
                "turns": [],
            }
        )
    result = run_generation(job, FakeFactory())
    assert result.stats["generated_tokens_total"] < 10_000
    assert [r["index"] for r in result.rows] == expected_selection(
        prompts, token_budget=30
    ).selected


# --------------------------------------------------------------------------- properties


def test_property_random_runs_with_kills(tmp_path):
    rng = random.Random(1234)
    for case in range(25):
        n = rng.randint(0, 40)
        prompts = make_prompts(n, tag=f"c{case}-")
        fail = {user_texts(p)[0] for p in prompts if rng.random() < 0.1}
        budget = rng.choice([None, rng.randint(0, 300)])
        max_samples = rng.choice([None, None, rng.randint(0, 30)])
        batch_size = rng.randint(1, 6)
        kw = {"token_budget": budget, "max_samples": max_samples, "batch_size": batch_size}
        ref = run_generation(
            make_job(tmp_path / f"{case}ref", prompts, **kw), FakeFactory(fail=fail)
        )

        job = make_job(tmp_path / f"{case}run", prompts, **kw)
        asked: list[str] = []
        for _ in range(rng.randint(0, 3)):
            f = FakeFactory(fail=fail, raise_after_calls=rng.randint(0, 3))
            with contextlib.suppress(EngineKilled):
                run_generation(job, f)
            asked += [k for e in f.engines for k in e.asked_keys]
        f = FakeFactory(fail=fail)
        result = run_generation(job, f)
        asked += [k for e in f.engines for k in e.asked_keys]

        ctx = (case, n, budget, max_samples, batch_size)
        want = expected_selection(prompts, token_budget=budget, max_samples=max_samples, fail=fail)
        assert [r["index"] for r in result.rows] == want.selected, ctx
        assert [x["index"] for x in result.stats["failures"]] == want.failed, ctx
        assert rows_bytes(result) == rows_bytes(ref), ctx
        assert len(asked) == len(set(asked)), ctx
        assert f.calls <= 1, ctx
        check_stats(result, job)


def test_fake_engine_is_deterministic():
    e1, e2 = FakeEngine(), FakeEngine()
    conv = [[{"role": "user", "content": "hi"}]]
    assert e1.complete(conv, seed=1) == e2.complete(conv, seed=2)
    assert len(e1.calls) == 1 and e1.asked_keys == e2.asked_keys


def test_engine_returning_the_wrong_number_of_results_is_an_error(tmp_path):
    class Short(FakeEngine):
        def complete(self, conversations, *, seed):
            return super().complete(conversations, seed=seed)[:-1]

    prompts = make_prompts(6)
    job = make_job(tmp_path, prompts)
    with pytest.raises(ValueError):
        run_generation(job, Short)
    assert list(read_journal(job.journal)) == []  # nothing misattributed was recorded


class _HangsUntilCancelled:
    """An HTTP-style engine: "q 0" answers at once with 10 tokens, the rest wait until
    they are cancelled; ``on_cancel`` says what the cancelled "q 2" raises."""

    capacity = 4

    def __init__(self, on_cancel: BaseException) -> None:
        self.on_cancel = on_cancel

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def complete(self, messages, tools=None):
        import asyncio

        from eagle3data.generation.engines import Completion

        if messages[-1]["content"] == "q 0":
            return Completion("a", "stop", prompt_tokens=1, completion_tokens=10)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if messages[-1]["content"] == "q 2":
                raise self.on_cancel from None
            raise
        raise AssertionError("unreachable")


@pytest.mark.parametrize("transient", [True, False])
def test_a_cancelled_request_that_fails_is_abandoned_only_if_the_failure_is_transient(
    tmp_path: Path, transient: bool
) -> None:
    """Cancelling what the prefix no longer needs: a request that ends in a transient error
    on its way out (a dropped connection) decoded what it decoded: abandoned, like the
    others. Any other exception is a bug, and must not be journaled away as waste."""
    from eagle3data.generation.engines import TransientError

    prompts = [make_prompt(f"p{i}", [{"role": "user", "content": f"q {i}"}]) for i in range(4)]
    j = GenerationJob(
        dataset="A1",
        prompts=prompts,
        journal=tmp_path / "journal.jsonl",
        model="m",
        sampling=SAMPLING,
        token_budget=10,
        progress_interval_s=0,
    )
    error = TransientError("connection reset") if transient else RuntimeError("engine bug")
    engine = _HangsUntilCancelled(error)
    if transient:
        result = run_generation(j, lambda: engine, streaming=True)
        assert [r["id"] for r in result.rows] == ["p0"]
        assert result.stats["abandoned_requests"] == 3
        return
    with pytest.raises(RuntimeError, match="engine bug"):
        run_generation(j, lambda: engine, streaming=True)
    # What was known is journaled all the same: the answer and the two plain cancels.
    lines = [json.loads(line) for line in j.journal.read_text().splitlines()]
    assert sorted((r["id"], r["status"]) for r in lines) == [
        ("p0", "ok"),
        ("p1", "abandoned"),
        ("p3", "abandoned"),
    ]


def test_a_journal_record_of_a_kind_this_build_does_not_know_is_named_with_versions(
    tmp_path: Path,
) -> None:
    """A newer build's journal, read by this one: one line naming the file, the line, the
    status and this build's version (builds before abandoned records crashed deep inside
    on them)."""
    from eagle3data import __version__
    from eagle3data.errors import JournalCorruptError

    prompts = make_prompts(2)
    journal = tmp_path / "journal.jsonl"
    newer = {"id": prompts[0].id, "prompt_hash": prompts[0].prompt_hash, "status": "paused"}
    journal.write_text(dumps_line(newer))
    j = GenerationJob(dataset="A1", prompts=prompts, journal=journal, model="m", sampling=SAMPLING)
    with pytest.raises(JournalCorruptError) as caught:
        run_generation(j, no_engine)
    message = str(caught.value)
    assert message.startswith(f"{journal}:1: a record of status 'paused'")
    assert f"eagle3data {__version__}" in message and "ok, failed, abandoned" in message
