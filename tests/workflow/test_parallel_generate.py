"""The generate rule with an HTTP backend: every dataset's job runs at once (they wait on
the server, not on cores), and together they keep the one ``concurrency`` configured."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from support.fake_openai import FakeOpenAIServer
from support.workflow import alpaca_prompts, sharegpt_prompts, write_prompts

pytestmark = pytest.mark.e2e

CONCURRENCY = 3


class Arrivals:
    """The dataset of each request the server receives (its prompts name it), in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, str]] = []
        self._lock = threading.Lock()

    def __call__(self, body: dict[str, Any], attempt: int) -> None:
        text = " ".join(str(m.get("content")) for m in body["messages"])
        with self._lock:
            self.seen.append((time.monotonic(), "A1" if "Question" in text else "B2"))

    def span(self, dataset: str) -> tuple[float, float]:
        times = [t for t, d in self.seen if d == dataset]
        return times[0], times[-1]

    def alternations(self) -> int:
        order = [d for _, d in sorted(self.seen)]
        return sum(1 for a, b in itertools.pairwise(order) if a != b)


def test_datasets_generate_at_once_sharing_one_concurrency(make_workflow, tmp_path: Path) -> None:
    a1 = write_prompts(tmp_path / "A1.jsonl", sharegpt_prompts(24))  # "Question i: ..."
    b2 = write_prompts(tmp_path / "B2.jsonl", alpaca_prompts(24))  # "Rewrite sentence i ..."
    datasets = {
        "A1": {"path": str(a1), "format": "sharegpt"},
        "B2": {"path": str(b2), "format": "alpaca"},
    }
    arrivals = Arrivals()
    # 0.16 s per answer (max_tokens 8): each dataset's 29 requests at 3 in flight take about
    # 1.5 s alone, more than the jobs' starts (their imports) stagger them.
    with FakeOpenAIServer(model="tiny", faults=arrivals, tokens_per_s=50) as server:
        wf = make_workflow(
            datasets,
            generation={
                "backend": "openai",
                "endpoints": [server.url],
                "served_model": "tiny",
                "concurrency": CONCURRENCY,
            },
        )
        # The rule's own threads (no --set-threads) on two cores: before, generate took both
        # and the datasets went one after the other.
        targets = [f"results/responses/{ds}.jsonl" for ds in datasets]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        proc = subprocess.run(
            [sys.executable, "-m", "snakemake", "--cores", "2", *targets],
            cwd=wf.root,
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        peak = server.stats["max_in_service"]
    (a_first, a_last), (b_first, b_last) = arrivals.span("A1"), arrivals.span("B2")
    assert max(a_first, b_first) < min(a_last, b_last), "both generate jobs ran at once"
    assert arrivals.alternations() >= 4, arrivals.alternations()
    assert peak <= CONCURRENCY, f"the server held {peak} requests at once (configured 3)"
    for ds in datasets:
        assert len(wf.responses(ds)) == 24
        log = wf.path(f"logs/generate/{ds}.log").read_text()
        assert "shared with the run's other generate jobs" in log, log
