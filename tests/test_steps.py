"""How a stage ends: user errors as one log line, bugs with their traceback, and
neither path imports anything heavy on the way out (a SIGTERM waits for it)."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

from eagle3data import steps
from eagle3data.chat import ChatTemplateError
from eagle3data.engines.openai_engine import EngineUnavailable
from eagle3data.generation import GenerationAborted
from eagle3data.gpu_slots import GpuSlotError
from eagle3data.journal import JournalCorruptError, JournalLockedError
from eagle3data.layers import AuxLayerError
from eagle3data.prompts import PromptFormatError
from eagle3data.shards import ShardFormatError
from eagle3data.vocab import DraftVocabError


@pytest.mark.parametrize(
    "error",
    [
        AuxLayerError,
        ChatTemplateError,
        DraftVocabError,
        EngineUnavailable,
        GenerationAborted,
        GpuSlotError,
        JournalCorruptError,
        JournalLockedError,
        PromptFormatError,
        ShardFormatError,
        steps.DiskSpaceError,
        steps.ValidationError,
        FileNotFoundError,
    ],
)
def test_user_errors_end_the_job_with_one_line(error, tmp_path) -> None:
    def step() -> None:
        raise error("datasets.A1.path: no such file")

    log = tmp_path / "job.log"
    with pytest.raises(SystemExit) as exit_:
        steps.run_step(str(log), step)
    assert exit_.value.code == 1
    [line] = log.read_text().splitlines()
    assert line.endswith(" ERROR datasets.A1.path: no such file")


def test_bugs_keep_their_traceback(tmp_path) -> None:
    def step() -> None:
        raise KeyError("oops")

    log = tmp_path / "job.log"
    with pytest.raises(SystemExit):
        steps.run_step(str(log), step)
    text = log.read_text()
    assert " ERROR step failed\nTraceback (most recent call last):" in text
    assert text.rstrip().endswith("KeyError: 'oops'")


@pytest.fixture(autouse=True)
def _restore_logging():
    """run_step configures the root logger for a job process; undo it for later tests."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            handler.close()
    root.handlers[:] = handlers
    root.setLevel(level)


def test_failing_imports_nothing_heavy() -> None:
    code = textwrap.dedent(
        """
        import sys
        from eagle3data import steps
        from eagle3data.generation import GenerationAborted
        before = set(sys.modules)
        def step():
            raise GenerationAborted("A1: stopped by SIGTERM")
        try:
            steps.run_step(None, step)
        except SystemExit:
            pass
        heavy = sorted(m for m in set(sys.modules) - before if m.split(".")[0] in
                       {"torch", "transformers", "eagle3data"})
        print(heavy)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout
