"""How a stage ends: user errors as one log line, bugs with their traceback, and
neither path imports anything heavy on the way out (a SIGTERM waits for it)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys
import textwrap

import pytest

import eagle3data
from eagle3data import errors
from eagle3data.gpu_slots import GpuRequest
from eagle3data.jobs import run_step

# run_step configures this process as a job; undone after each test (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("in_process_job")

USER_ERRORS = [
    cls
    for _, cls in inspect.getmembers(errors, inspect.isclass)
    if issubclass(cls, errors.UserError) and cls is not errors.UserError
]


def all_modules() -> list[str]:
    prefix = eagle3data.__name__ + "."
    return [m.name for m in pkgutil.walk_packages(eagle3data.__path__, prefix)]


@pytest.mark.parametrize("error", [*USER_ERRORS, FileNotFoundError], ids=lambda c: c.__name__)
def test_user_errors_end_the_job_with_one_line(error, tmp_path) -> None:
    def step() -> None:
        raise error("datasets.A1.path: no such file")

    log = tmp_path / "job.log"
    with pytest.raises(SystemExit) as exit_:
        run_step(str(log), step)
    assert exit_.value.code == 1
    [line] = log.read_text().splitlines()
    assert line.endswith(" ERROR datasets.A1.path: no such file")


@pytest.mark.parametrize("error", USER_ERRORS, ids=lambda c: c.__name__)
def test_user_errors_keep_the_builtin_base_callers_expect(error) -> None:
    assert issubclass(error, ValueError | RuntimeError)
    assert error.__name__ in errors.__doc__, "the tree in the module docstring lists it"


# Exceptions that never end a job: signals between the parts of one stage.
INTERNAL = {
    "eagle3data.servers.http.TransientError",  # retried, then dispatched again
    "eagle3data.prompts.problems.Bad",  # becomes a PromptFormatError or a recorded skip
    "eagle3data.prompts.problems.UnreadableImage",  # a Bad that is always a recorded skip
    "eagle3data.images.ImageError",  # raised at ingest, where it becomes a recorded skip
    "eagle3data.prompts.file_format.CorruptStream",  # becomes a PromptFormatError naming the file
    # caught by the engine: the endpoint falls back to text (issue 32, point 6)
    "eagle3data.servers.openai_chat.UnknownTokenIds",
    "eagle3data.driver_signals.StopSignal",  # SIGINT/SIGTERM: run_step ends with one line
    # The capture engine's own control flow, never out of it.
    "eagle3data.hidden_states.capture_service._ClientGone",
    "eagle3data.hidden_states.capture_service._StopEngine",
}


def test_every_other_exception_class_is_a_user_error() -> None:
    """One error base: an exception a user can meet is defined in errors.py."""
    defined = {}
    for name in all_modules():
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__ == name:
                defined[f"{name}.{cls.__name__}"] = cls
    strays = sorted(
        k for k in defined if k not in INTERNAL and not k.startswith("eagle3data.errors.")
    )
    assert strays == []


def test_bugs_keep_their_traceback(tmp_path) -> None:
    def step() -> None:
        raise KeyError("oops")

    log = tmp_path / "job.log"
    with pytest.raises(SystemExit):
        run_step(str(log), step)
    text = log.read_text()
    assert " ERROR step failed\nTraceback (most recent call last):" in text
    assert text.rstrip().endswith("KeyError: 'oops'")


def test_gpus_that_cannot_be_had_end_the_job_with_one_line(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    ran = []
    log = tmp_path / "job.log"
    with pytest.raises(SystemExit):
        run_step(str(log), lambda: ran.append(1), gpus=GpuRequest(count=3, machine_gpus=2))
    assert ran == [], "the stage never starts without its GPUs"
    [line] = log.read_text().splitlines()
    assert line.endswith("ERROR this job needs 3 GPU(s) but this machine has 2 "
                         "(from config gpus.count or nvidia-smi -L)")  # fmt: skip


def test_failing_imports_nothing_heavy() -> None:
    code = textwrap.dedent(
        """
        import sys
        from eagle3data.errors import GenerationAborted
        from eagle3data.jobs import run_step
        before = set(sys.modules)
        def step():
            raise GenerationAborted("A1: stopped by SIGTERM")
        try:
            run_step(None, step)
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
