"""What a job says while it works and when it is stopped: SIGINT or SIGTERM ends it with
one line (what was kept, that the same command resumes) and no traceback; the
in-process engine reports a long batch while it runs; libraries draw no progress bars."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.fakes import FakeEngine, single_turn
from support.workflow import REPO

from eagle3data.driver_signals import StopSignal
from eagle3data.errors import GenerationAborted
from eagle3data.generation.driver import GenerationJob, run_generation
from eagle3data.generation.journal import read_journal
from eagle3data.liveness import read_run

SRC = str(REPO / "src")


def _job_script(body: str) -> str:
    """A job process: ``body`` defines ``step``, run as every Snakemake script runs it."""
    return textwrap.dedent(
        f"""
        import os, signal, sys, time
        sys.path.insert(0, {SRC!r})
        from eagle3data.jobs import run_step
        """
    ) + textwrap.dedent(body)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_job_says_so_in_one_line(tmp_path: Path, sig: signal.Signals) -> None:
    log = tmp_path / "job.log"
    code = _job_script(
        f"""
        def tokenize():
            os.kill(os.getpid(), {int(sig)})
            time.sleep(30)  # where the signal lands

        run_step({str(log)!r}, tokenize)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    [line] = log.read_text().splitlines()
    assert line.endswith(
        f" ERROR tokenize stopped by {sig.name}; finished outputs are kept and nothing partial "
        "was written; run the same command to resume"
    )


class _StoppedAfter(FakeEngine):
    """A fake engine whose ``calls``-th call is interrupted by a signal, as torch is."""

    def __init__(self, calls: int, sig: signal.Signals) -> None:
        super().__init__()
        self.stop_at, self.sig = calls, sig

    def complete(self, conversations, *, seed):  # type: ignore[no-untyped-def]
        if len(self.calls) == self.stop_at:
            raise StopSignal(self.sig)
        return super().complete(conversations, seed=seed)


def test_a_stopped_generation_says_what_it_kept(tmp_path: Path) -> None:
    journal = tmp_path / "B2.jsonl"
    job = GenerationJob(
        dataset="B2",
        prompts=[single_turn(f"q{i}", f"question {i}") for i in range(12)],
        journal=journal,
        model="m",
        sampling={"max_tokens": 32},
        batch_size=2,
        progress_interval_s=0,
    )
    with pytest.raises(GenerationAborted) as stopped:
        run_generation(job, lambda: _StoppedAfter(3, signal.SIGTERM))
    assert str(stopped.value) == (
        f"B2: stopped by SIGTERM; 6 responses finished in this run are kept (6 in {journal}); "
        "run the same command to resume"
    )
    assert len(list(read_journal(journal))) == 6
    run = read_run(journal)
    assert run is not None and run.ended_at is not None  # status: stopped, not running

    # The next run resumes: the same message counts this run's responses only.
    with pytest.raises(GenerationAborted, match="stopped by SIGINT; 2 responses finished in this "
                       r"run are kept \(8 in "):  # fmt: skip
        run_generation(job, lambda: _StoppedAfter(1, signal.SIGINT))


def test_a_signal_during_a_journal_append_waits_for_its_counts(tmp_path: Path) -> None:
    # A real SIGINT lands right after a batch reached the journal and before the run
    # counted it (seen in CI: "10 responses ... are kept" beside 12 in the journal).
    log, journal = tmp_path / "job.log", tmp_path / "B2.jsonl"
    code = _job_script(
        f"""
        sys.path.insert(0, {str(REPO / "tests")!r})
        from pathlib import Path
        from support.fakes import FakeEngine, single_turn
        from eagle3data.generation import driver
        from eagle3data.generation.journal import JournalWriter

        appended = JournalWriter.append_many

        def append_then_stop(self, records):
            appended(self, records)
            if sum(1 for _ in open(self.path)) >= 4:
                os.kill(os.getpid(), signal.SIGINT)

        JournalWriter.append_many = append_then_stop
        job = driver.GenerationJob(
            dataset="B2", prompts=[single_turn(f"q{{i}}", f"q {{i}}") for i in range(12)],
            journal=Path({str(journal)!r}), model="m", sampling={{"max_tokens": 8}},
            batch_size=2, progress_interval_s=0,
        )
        run_step({str(log)!r}, lambda: driver.run_generation(job, FakeEngine))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr + log.read_text()
    [line] = [x for x in log.read_text().splitlines() if "stopped by" in x]
    assert len(list(read_journal(journal))) == 4
    assert f"B2: stopped by SIGINT; 4 responses finished in this run are kept (4 in {journal})" in (
        line
    )


def test_the_engine_reports_a_batch_while_it_runs(tiny_model_dir: Path, caplog) -> None:
    from eagle3data.generation.engines.transformers_engine import TransformersEngine

    sampling = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 6,
                "repetition_penalty": 1.0, "stop": []}  # fmt: skip
    engine = TransformersEngine(
        str(tiny_model_dir), sampling=sampling, device="cpu", progress_interval_s=0, label="B2"
    )
    conversations = [[{"role": "user", "content": f"Say {i}."}] for i in range(3)]
    with caplog.at_level(logging.INFO, logger="eagle3data.generation.engines"):
        quiet = engine.complete(conversations, seed=1)
        lines = [r.getMessage() for r in caplog.records]
    # One line per generated token (interval 0), each saying how far the batch has got.
    assert lines[0].startswith("B2: batch of 3: 1/6 tokens each so far, ")
    assert len(lines) == max(c.completion_tokens for c in quiet)
    # Reporting changes nothing that is generated.
    engine.progress_interval_s = None
    assert engine.complete(conversations, seed=1) == quiet


def test_library_progress_bars_stay_out_of_job_logs(tiny_model_dir: Path) -> None:
    code = _job_script(
        f"""
        def load():
            from eagle3data.target import load_causal_lm
            load_causal_lm({str(tiny_model_dir)!r}, dtype="auto", device="cpu",
                           trust_remote_code=False)
            print("loaded", file=sys.stderr)

        run_step(None, load)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "loaded" in proc.stderr and "Loading weights" not in proc.stderr
