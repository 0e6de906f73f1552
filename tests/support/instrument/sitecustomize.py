"""Test-only instrumentation, imported by Python at start-up when this directory is on
``PYTHONPATH`` (the chaos tests put it there for the workflows they kill).

With ``EAGLE3DATA_CALL_LOG`` set, every conversation the in-process engine finishes is
appended to that file as one JSON line (its messages) right after the engine returns it,
so a test can count engine work across processes that get killed at any moment.

With ``EAGLE3DATA_ENGINE_CALL_DELAY_S`` set too, each engine call first waits that many
seconds: generation takes the same time on a fast machine as on a slow one, so a kill
timed to land while it runs does (the output does not change).

With ``EAGLE3DATA_LOAD_LOG`` set, every load of the target by the transformers capture
backend (``HiddenStateExtractor``) appends ``{"pid": ...}`` to that file: how a test counts
the loads of a capture phase from outside the code that should avoid them.

With ``EAGLE3DATA_STACK_DIR`` set, SIGUSR1 makes any Python process (Snakemake's
driver, its job runners, our scripts) write the stacks of all its threads to
``<dir>/<pid>.txt``: how a test shows where a run that does not stop is stuck.
"""

from __future__ import annotations

import faulthandler
import importlib.abc
import importlib.machinery
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any

CALL_LOG = os.environ.get("EAGLE3DATA_CALL_LOG")
LOAD_LOG = os.environ.get("EAGLE3DATA_LOAD_LOG")
CALL_DELAY_S = float(os.environ.get("EAGLE3DATA_ENGINE_CALL_DELAY_S") or 0)
STACK_DIR = os.environ.get("EAGLE3DATA_STACK_DIR")
ENGINE_MODULE = "eagle3data.generation.engines.transformers_engine"
CAPTURE_MODULE = "eagle3data.hidden_states.transformers_capture"


def _append(path: str, lines: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, lines.encode())  # one O_APPEND write: lines of concurrent jobs never mix
    finally:
        os.close(fd)


def _record(conversations: Sequence[Any]) -> None:
    assert CALL_LOG is not None
    _append(CALL_LOG, "".join(json.dumps(list(c), sort_keys=True) + "\n" for c in conversations))


def _count_loads(module: ModuleType) -> None:
    extractor = module.HiddenStateExtractor
    init = extractor.__init__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        assert LOAD_LOG is not None
        _append(LOAD_LOG, json.dumps({"pid": os.getpid()}) + "\n")
        init(self, *args, **kwargs)

    extractor.__init__ = counted


def _count_calls(module: ModuleType) -> None:
    engine = module.TransformersEngine
    complete = engine.complete

    def counted(self: Any, conversations: Sequence[Any], *, seed: int) -> Any:
        if CALL_DELAY_S:
            time.sleep(CALL_DELAY_S)
        results = complete(self, conversations, seed=seed)
        _record(conversations)
        return results

    engine.complete = counted


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.patches: dict[str, Any] = {}

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


_patcher = _PatchOnImport()
if CALL_LOG:
    _patcher.patches[ENGINE_MODULE] = _count_calls
if LOAD_LOG:
    _patcher.patches[CAPTURE_MODULE] = _count_loads
if _patcher.patches:
    sys.meta_path.insert(0, _patcher)

if STACK_DIR:
    # Kept open for the process's life: faulthandler writes to its descriptor.
    _stacks = open(os.path.join(STACK_DIR, f"{os.getpid()}.txt"), "a")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=_stacks, all_threads=True)
