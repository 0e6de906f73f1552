"""Requests cancelled in flight (the journal's abandoned records) as the status command,
its what-if and the dry run read them: waste that decides no prompt. The prefix is what
the outcomes alone select, as a re-run selects it (the driver's ``load_journal``: the
first ok or failed record of each current prompt); the waste is every current record's
decode, the abandoned ones too, minus the prefix's completion tokens (the generate
stats' ``waste_tokens``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from support.workflow import REPO

from eagle3data import atomic
from eagle3data.atomic import dumps_line
from eagle3data.config import load_config, schema_for
from eagle3data.layout import Results
from eagle3data.liveness import run_file
from eagle3data.monitor.preview import journal_path, preview_lines
from eagle3data.monitor.status import main
from eagle3data.monitor.whatif import Change, apply_changes

PROMPTS = 6


def _ok(i: int, tokens: int) -> dict[str, Any]:
    return {"id": f"p{i}", "prompt_hash": f"h{i}", "status": "ok",
            "usage": {"prompt_tokens": 10, "completion_tokens": tokens},
            "turns": [{"prompt_tokens": 10, "completion_tokens": tokens}],
            "finished_at": 1010.0 + i}  # fmt: skip


def _failed(i: int, spent: int) -> dict[str, Any]:
    return {"id": f"p{i}", "prompt_hash": f"h{i}", "status": "failed", "error": "x",
            "completion_tokens_spent": spent, "finished_at": 1020.0 + i}  # fmt: skip


def _abandoned(i: int, spent: int, source: str = "server") -> dict[str, Any]:
    return {"id": f"p{i}", "prompt_hash": f"h{i}", "status": "abandoned",
            "completion_tokens_spent": spent, "spent_source": source,
            "finished_at": 1030.0 + i}  # fmt: skip


# p1 cancelled before its ok, p0 cancelled after its ok (a second dispatch), p3 cancelled
# and never finished (undecided: the prefix stops there), p5 cancelled under an older text.
JOURNAL = [
    _ok(0, 10),
    _abandoned(1, 7),
    _ok(1, 20),
    _abandoned(0, 4, "estimate"),
    _failed(2, 3),
    _abandoned(3, 5, "estimate"),
    _ok(4, 30),
    _ok(5, 40),
    {**_abandoned(5, 100), "prompt_hash": "an older prompt text"},
]
OUTCOME_TOKENS = 10 + 20 + 3 + 30 + 40  # the first outcome of each prompt
CANCELLED, CANCELLED_ESTIMATED = 7 + 4 + 5, 4 + 5
OUTCOMES = [r for r in JOURNAL if r["status"] != "abandoned"]


def _workflow(root: Path, records: list[dict[str, Any]]) -> Path:
    """A workflow directory whose dataset B2 has prepared prompts and this journal."""
    (root / "config").mkdir(parents=True)
    (root / "Snakefile").write_text("")
    shutil.copy(REPO / "config" / "schema.yaml", root / "config" / "schema.yaml")
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64, "dtype": "bfloat16"}')
    config = {"model": {"path": str(model)}, "datasets": {"B2": {"path": "x.jsonl"}}}
    (root / "config" / "config.yaml").write_text(json.dumps(config))
    prompts = root / "results" / "prompts" / "B2.parquet"
    prompts.parent.mkdir(parents=True)
    pl.DataFrame(
        {
            "index": list(range(PROMPTS)),
            "id": [f"p{i}" for i in range(PROMPTS)],
            "prompt_hash": [f"h{i}" for i in range(PROMPTS)],
        }
    ).write_parquet(prompts)
    journal = _journal(root)
    journal.parent.mkdir(parents=True)
    journal.write_text("".join(dumps_line(r) for r in records))
    return root


def _config(root: Path) -> dict[str, Any]:
    return load_config(root / "config" / "config.yaml", schema_for(root))


def _journal(root: Path) -> Path:
    path = journal_path(_config(root), "B2", Results(root))
    assert path is not None
    return path


def _status(root: Path, capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["-d", str(root), "--json", *args]) == 0
    [row] = json.loads(capsys.readouterr().out)["datasets"]
    return row  # type: ignore[no-any-return]


def test_the_status_counts_the_cancelled_decode_as_waste(tmp_path, capsys) -> None:
    wf = _workflow(tmp_path / "wf", JOURNAL)
    row = _status(wf, capsys)
    # p0 and p1 (p1's abandoned record before its ok decides nothing); p2 failed; p3 undecided.
    assert (row["conversations_done"], row["completion_tokens"], row["failed"]) == (2, 30, 1)
    assert row["stop_reason"] is None and row["projection_basis"] == "extrapolated"
    assert row["generated_tokens"] == OUTCOME_TOKENS + CANCELLED
    assert row["waste_tokens"] == OUTCOME_TOKENS + CANCELLED - 30
    assert (
        row["abandoned_requests"],
        row["abandoned_tokens"],
        row["abandoned_tokens_estimated"],
    ) == (3, CANCELLED, CANCELLED_ESTIMATED)
    assert main(["-d", str(wf)]) == 0
    table = capsys.readouterr().out
    assert f"  {OUTCOME_TOKENS + CANCELLED - 30} (~{CANCELLED} cancelled)  " in table


def test_the_rate_counts_what_cancelled_requests_decoded(tmp_path, capsys) -> None:
    """The engine decoded them: a stopped run's average rate counts their tokens too."""
    wf = _workflow(tmp_path / "wf", JOURNAL)
    run = {"host": atomic.HOST, "pid": 1, "started_at": 1000.0, "ended_at": 1100.0}
    run_file(_journal(wf)).write_text(json.dumps(run))
    row = _status(wf, capsys)
    assert row["projection_rate_basis"] == "last run"
    # Every current record finished within the run: its tokens over its 100 s.
    assert row["projection_rate"] == pytest.approx((OUTCOME_TOKENS + CANCELLED) / 100)


# Each change's selection as a re-run makes it: conversations, completion tokens, stop.
LIMITS = [
    ([], (2, 30, None)),
    (["--budget", "B2=25"], (1, 10, "token_budget")),  # p1's 20 would pass it
    (["--budget", "B2=30"], (2, 30, "token_budget")),
    (["--max-samples", "B2=1"], (1, 10, "max_samples")),
]
DIFFERENT = ("generated_tokens", "waste_tokens", "abandoned_requests", "abandoned_tokens",
             "abandoned_tokens_estimated")  # fmt: skip


@pytest.mark.parametrize(("args", "selected"), LIMITS)
def test_cancelled_requests_change_no_selection(tmp_path, capsys, args, selected) -> None:
    """The status and its what-if with and without the abandoned records: the same rows
    but for the waste, which holds their decode."""
    cancelled = _status(_workflow(tmp_path / "with", JOURNAL), capsys, *args)
    without = _status(_workflow(tmp_path / "without", OUTCOMES), capsys, *args)
    got = (cancelled["conversations_done"], cancelled["completion_tokens"])
    assert (*got, cancelled["stop_reason"]) == selected
    assert {k: v for k, v in cancelled.items() if k not in DIFFERENT} == {
        k: v for k, v in without.items() if k not in DIFFERENT
    }
    assert cancelled["waste_tokens"] == OUTCOME_TOKENS + CANCELLED - selected[1]
    assert without["waste_tokens"] == OUTCOME_TOKENS - selected[1]


def _preview(root: Path, changes: list[Change]) -> list[str]:
    config = _config(root)
    changed = apply_changes(config, changes, schema_for(root)) if changes else config
    # Not the total's line: it names the directory and its free space.
    return [x for x in preview_lines(changed, Results(root)) if not x.startswith("  total: ")]


@pytest.mark.parametrize(
    "changes",
    [[], [Change("B2", "token_budget", 25)], [Change("B2", "max_samples", 1)]],
    ids=["undecided", "budget", "max_samples"],
)
def test_the_dry_run_selects_what_the_outcomes_select(tmp_path, changes) -> None:
    cancelled = _preview(_workflow(tmp_path / "with", JOURNAL), changes)
    without = _preview(_workflow(tmp_path / "without", OUTCOMES), changes)
    if not changes:  # not decided: what is done and what is to go, no waste
        assert cancelled == without
        assert cancelled[1].startswith("  B2: 30 completion tokens in 2 conversations; about ")
        return
    # Decided: the same prefix and estimate; the waste holds the cancelled decode.
    assert cancelled[2:] == without[2:]
    done = "  B2: done: 10 completion tokens in 1 conversations (limits: "
    assert cancelled[1].startswith(done) and without[1].startswith(done)
    assert f"; waste {OUTCOME_TOKENS - 10} tokens;" in without[1]
    assert (
        f"; waste {OUTCOME_TOKENS + CANCELLED - 10} tokens ({CANCELLED} of them cancelled in "
        f"flight, {CANCELLED_ESTIMATED} estimated);"
    ) in cancelled[1]


def test_the_what_if_says_what_cancelled_requests_wasted(tmp_path, capsys) -> None:
    wf = _workflow(tmp_path / "wf", JOURNAL)
    assert main(["-d", str(wf), "--budget", "B2=25"]) == 0
    out = capsys.readouterr().out
    waste = OUTCOME_TOKENS + CANCELLED - 10
    assert (
        "    output: 1 conversations, 10 completion tokens (decided: it stops at token_budget)\n"
        f"    already generated: {OUTCOME_TOKENS + CANCELLED} completion tokens, {waste} of them "
        f"wasted ({CANCELLED} of them cancelled in flight, {CANCELLED_ESTIMATED} estimated)\n"
    ) in out


def test_a_newer_builds_record_kind_is_named_by_the_status_and_the_dry_run(
    tmp_path, capsys
) -> None:
    """A record kind this build does not know is no outcome and no waste it can count: the
    status stops in one line naming the journal's line, and the dry run says it for that
    dataset, instead of counting it (it was an ok of 0 tokens)."""
    wf = _workflow(tmp_path / "wf", [*JOURNAL, {**_ok(3, 9), "status": "paused"}])
    where = f"{_journal(wf)}:{len(JOURNAL) + 1}: a record of status 'paused'"
    assert main(["-d", str(wf)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"eagle3data-status: {where}") and err.count("\n") == 1
    assert _preview(wf, [])[1].startswith(f"  B2: {where}")
