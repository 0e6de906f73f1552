"""Real vLLM on CPU (tests/support/vllm_server.py): the server runs from .venv-vllm, the
tests here from .venv. Every test here skips, with the reason and the command that runs
them, when that interpreter (or $EAGLE3DATA_VLLM_PYTHON) cannot import vllm 0.32.0."""

from __future__ import annotations

import pytest
from support.vllm_server import vllm_problem


def _here(item: pytest.Item) -> bool:
    nodeid = item.nodeid.replace("\\", "/")
    return "tests/vllm/" in nodeid or nodeid.startswith("vllm/")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # This hook sees the whole session's items: only ours are skipped, and vLLM is asked
    # only when one of them was collected (the import takes seconds).
    ours = [item for item in items if _here(item)]
    problem = vllm_problem() if ours else None
    if problem is None:
        return
    skip = pytest.mark.skip(reason=problem)
    for item in ours:
        item.add_marker(skip)
