"""The suite's share of the machine under pytest-xdist (the README's ``pytest -n 2``)."""

from __future__ import annotations

import os


def worker_threads() -> int:
    """The cores one test process may use: all of them without xdist, else an even share."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, (os.cpu_count() or 1) // workers)
