"""Real SGLang on CPU (tests/support/sglang_cpu.py): every test here skips, with the reason
and the command that runs them, in an environment without sglang 0.5.23."""

from __future__ import annotations

import pytest
from support.sglang_cpu import sglang_problem


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    problem = sglang_problem()
    if problem is None:
        return
    skip = pytest.mark.skip(reason=problem)
    for item in items:
        if "tests/sglang/" in item.nodeid.replace("\\", "/") or item.nodeid.startswith("sglang/"):
            item.add_marker(skip)
