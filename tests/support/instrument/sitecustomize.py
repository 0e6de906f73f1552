"""Test-only instrumentation, imported by Python at start-up when this directory is on
``PYTHONPATH`` (the chaos tests put it there for the workflows they kill).

With ``EAGLE3DATA_CALL_LOG`` set, every conversation the in-process engine finishes is
appended to that file as one JSON line (its messages) right after the engine returns it,
so a test can count engine work across processes that get killed at any moment.

With ``EAGLE3DATA_ENGINE_CALL_DELAY_S`` set too, each engine call first waits that many
seconds: generation takes the same time on a fast machine as on a slow one, so a kill
timed to land while it runs does (the output does not change).

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
CALL_DELAY_S = float(os.environ.get("EAGLE3DATA_ENGINE_CALL_DELAY_S") or 0)
STACK_DIR = os.environ.get("EAGLE3DATA_STACK_DIR")
ENGINE_MODULE = "eagle3data.generation.engines.transformers_engine"


def _record(conversations: Sequence[Any]) -> None:
    assert CALL_LOG is not None
    lines = "".join(json.dumps(list(c), sort_keys=True) + "\n" for c in conversations)
    fd = os.open(CALL_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, lines.encode())  # one O_APPEND write: lines of concurrent jobs never mix
    finally:
        os.close(fd)


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
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != ENGINE_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            _count_calls(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


if CALL_LOG:
    sys.meta_path.insert(0, _PatchOnImport())

if STACK_DIR:
    # Kept open for the process's life: faulthandler writes to its descriptor.
    _stacks = open(os.path.join(STACK_DIR, f"{os.getpid()}.txt"), "a")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=_stacks, all_threads=True)
