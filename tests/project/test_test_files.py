"""The suite collects as one: pytest imports test files by basename (no packages under
tests/), so two files of one name in different folders stop the whole collection."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_files_share_a_name() -> None:
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [name for name, n in names.items() if n > 1] == []


def test_under_xdist_a_test_runs_in_its_files_group(request: pytest.FixtureRequest) -> None:
    """tests/conftest.py groups the tests for ``pytest -n 2``: xdist schedules by the group
    its workers append to each nodeid. Without it (as before 2026-12-06: the workers were
    never told loadgroup) the tests of one group spread over both workers, and each built
    the shared runs and the package-index resolutions for itself."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip("runs under pytest -n (the README's test command)")
    assert request.node.nodeid.endswith("@tests/project/test_test_files.py")
