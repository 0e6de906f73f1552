"""What status knows about a run besides its journal: whether the job is alive (the
journal's run file, the job's run file, shard temporaries), the rate of the current run
only, and which stage is out of date (the whole thing on a real run:
tests/workflow/test_midnight.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

from eagle3data import atomic, liveness
from eagle3data.generation.journal import JournalWriter
from eagle3data.generation.records import SUMMARY_SCHEMA
from eagle3data.jobs import run_step
from eagle3data.layout import Results
from eagle3data.liveness import STALE_AFTER_S, read_run, run_file
from eagle3data.monitor.projection import current_rate, last_run_rate
from eagle3data.monitor.stages import dataset_stage


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write_run(journal: Path, **info: object) -> None:
    run_file(journal).write_text(json.dumps({"started_at": 1000.0, **info}))


def test_a_writer_is_running_until_it_closes(tmp_path: Path) -> None:
    journal = tmp_path / "k.jsonl"
    with JournalWriter(journal):
        run = read_run(journal)
        assert run is not None and (run.host, run.pid) == (atomic.HOST, os.getpid())
        assert run.ended_at is None and run.running(time.time())
    run = read_run(journal)
    assert run is not None and run.ended_at is not None and not run.running(time.time())
    assert read_run(tmp_path / "never.jsonl") is None


def test_a_killed_writer_is_not_running(tmp_path: Path) -> None:
    journal = tmp_path / "k.jsonl"
    _write_run(journal, host=atomic.HOST, pid=_dead_pid())  # kill -9: no end recorded
    run = read_run(journal)
    assert run is not None and not run.running(time.time())


def test_another_hosts_writer_is_judged_by_its_heartbeat(tmp_path: Path) -> None:
    journal = tmp_path / "k.jsonl"
    _write_run(journal, host="elsewhere", pid=_dead_pid())  # its pid means nothing here
    now = time.time()
    assert read_run(journal).running(now)  # type: ignore[union-attr]
    stale = now - STALE_AFTER_S - 1
    os.utime(run_file(journal), (stale, stale))
    assert not read_run(journal).running(now)  # type: ignore[union-attr]


def test_the_heartbeat_keeps_the_run_file_fresh(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(liveness, "HEARTBEAT_S", 0.05)
    journal = tmp_path / "k.jsonl"
    with JournalWriter(journal):
        old = time.time() - 1000
        os.utime(run_file(journal), (old, old))
        time.sleep(0.5)
        assert run_file(journal).stat().st_mtime > old + 900


@pytest.mark.usefixtures("in_process_job")
def test_a_job_is_alive_while_its_step_runs(tmp_path: Path) -> None:
    """Every job (tokenize, shards, validate ...), not only generation: its run file
    sits beside its log, as status looks for it."""
    results = Results(tmp_path)
    log = tmp_path / "logs" / "tokenize" / "A1.log"
    seen = []

    def tokenize() -> None:
        seen.append([read_run(p).running(time.time()) for p in results.job_logs("A1")])  # type: ignore[union-attr]

    run_step(str(log), tokenize)
    assert seen == [[True]]
    run = read_run(log)
    assert run is not None and run.ended_at is not None and not run.running(time.time())
    shard_log = tmp_path / "logs" / "hidden_states" / "A1" / "shard-00000.log"
    shard_log.parent.mkdir(parents=True)
    shard_log.write_text("")
    (tmp_path / "logs" / "tokenize" / "A10.log").write_text("")  # another dataset's
    assert results.job_logs("A1") == [shard_log, log]


def test_live_temporaries_are_this_hosts_live_writers(tmp_path: Path) -> None:
    live = tmp_path / f".shard-00000.h5.{atomic.HOST}_{os.getpid()}.x1y2.tmp"
    dead = tmp_path / f".shard-00001.h5.{atomic.HOST}_{_dead_pid()}.x1y2.tmp"
    other = tmp_path / f".shard-00002.h5.elsewhere_{os.getpid()}.x1y2.tmp"
    for path in (live, dead, other, tmp_path / "shard-00003.h5"):
        path.write_bytes(b"")
    assert atomic.live_temporaries(tmp_path) == [live]


def _records(*rows: tuple[float, int]) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "id": [f"p{i}" for i in range(len(rows))],
            "prompt_hash": ["h"] * len(rows),
            "failed": [False] * len(rows),
            "completion_tokens": [t for _, t in rows],
            "spent_tokens": [t for _, t in rows],
            "conversation_tokens": [t for _, t in rows],
            "finished_at": [at for at, _ in rows],
            "abandoned": [False] * len(rows),
            "spent_estimated": [0] * len(rows),
        },
        schema=SUMMARY_SCHEMA,
    )


def _run(tmp_path: Path, started_at: float, ended_at: float | None = None):
    journal = tmp_path / "k.jsonl"
    _write_run(journal, host=atomic.HOST, pid=os.getpid(), started_at=started_at, ended_at=ended_at)
    return read_run(journal)


def test_the_rate_counts_the_current_run_only(tmp_path: Path) -> None:
    # An earlier run journaled 6000 tokens; this one began at 1000 and made 50 since.
    records = _records((400.0, 6000), (1050.0, 20), (1090.0, 30))
    run = _run(tmp_path, started_at=1000.0)
    assert current_rate(records, run, now=1100.0) == pytest.approx(50 / 100)
    # Ten minutes on, only the last ten minutes count.
    later = _records((400.0, 6000), (1050.0, 20), (1650.0, 30))
    assert current_rate(later, run, now=1700.0) == pytest.approx(30 / 600)
    # Nothing journaled in the window: idle, no rate (printed "-"), never 0.
    assert current_rate(records, run, now=2000.0) is None


def test_a_stopped_run_keeps_only_its_average_rate(tmp_path: Path) -> None:
    records = _records((400.0, 6000), (1050.0, 20), (1090.0, 30))
    assert last_run_rate(records, _run(tmp_path, 1000.0, ended_at=1100.0)) == pytest.approx(0.5)
    # Killed (no end recorded): up to its last record.
    assert last_run_rate(records, _run(tmp_path, 1000.0)) == pytest.approx(50 / 90)
    assert last_run_rate(records, _run(tmp_path, 1200.0)) is None


def _touch(path: Path, at: float, text: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.utime(path, (at, at))
    return path


def _finished_dataset(root: Path) -> dict:
    """Every file of dataset A1 after a complete run, each newer than its inputs."""
    config = {"datasets": {"A1": {"token_budget": 100}}, "export": {"specforge": False}}
    r = root / "results"
    _touch(r / "prompts/A1.parquet", 1)
    _touch(r / "responses/A1.jsonl", 2)
    _touch(r / "responses/A1.records.parquet", 2)
    _touch(r / "responses/A1.stats.json", 2, json.dumps({"token_budget": 100}))
    _touch(r / "tokenized/A1.parquet", 3)
    _touch(r / "tokenized/A1.stats.json", 3)
    _touch(r / "hidden_states/A1/plan.json", 4, json.dumps({"shards": [{"shard": 0}]}))
    _touch(r / ".work/shards/A1/shard-00000.json", 4)
    _touch(r / "hidden_states/A1/shard-00000.h5", 5)
    _touch(r / "hidden_states/A1/manifest.json", 6)
    _touch(r / "vocab/draft_vocab.pt", 7)
    _touch(r / "vocab/draft_vocab.json", 7)
    _touch(r / "report/summary.html", 8)
    return config


def test_a_dataset_is_done_only_when_everything_after_it_is_newer(tmp_path: Path) -> None:
    config = _finished_dataset(tmp_path)
    results = Results(tmp_path)
    assert dataset_stage(results, "A1", config) == "done"
    _touch(tmp_path / "results/hidden_states/A1/manifest.json", 9)  # validated again
    assert dataset_stage(results, "A1", config) == "report"
    _touch(tmp_path / "results/tokenized/A1.parquet", 9)  # tokenized again
    assert dataset_stage(results, "A1", config) == "hidden_states"
    _touch(tmp_path / "results/.work/shards/A1/shard-00000.json", 10)  # and its plan rewritten
    _touch(
        tmp_path / "results/hidden_states/A1/plan.json", 10, json.dumps({"shards": [{"shard": 0}]})
    )
    assert dataset_stage(results, "A1", config) == "hidden_states"
    config["datasets"]["A1"]["token_budget"] = 200  # a budget changed since
    assert dataset_stage(results, "A1", config) == "generate"


def test_a_stale_draft_vocabulary_is_not_done(tmp_path: Path) -> None:
    config = _finished_dataset(tmp_path)
    os.utime(tmp_path / "results/vocab/draft_vocab.pt", (2.5, 2.5))  # older than tokenized
    assert dataset_stage(Results(tmp_path), "A1", config) == "draft_vocab"


def test_the_waste_cell_shows_what_cancelled_requests_decoded() -> None:
    from dataclasses import fields

    from eagle3data.monitor.snapshot import DatasetStatus, waste_cell

    blank = {f.name: None for f in fields(DatasetStatus)}
    row = DatasetStatus(**{**blank, "waste_tokens": 645, "abandoned_tokens": 0})
    assert waste_cell(row) == "645"
    row = DatasetStatus(**{**blank, "waste_tokens": 645, "abandoned_tokens": 119})
    assert waste_cell(row) == "645 (119 cancelled)"
    estimated = {"abandoned_tokens": 119, "abandoned_tokens_estimated": 40}
    row = DatasetStatus(**{**blank, "waste_tokens": 645, **estimated})
    assert waste_cell(row) == "645 (~119 cancelled)"
