"""How long `eagle3data-status` (and the dry-run estimate) take on a huge journal.

Writes a synthetic generation journal (default: one million records with ~1 kB of
response text each, like a real sidecar) and times, on the real code:

* the first summary of the journal (every line parsed once, cached),
* a repeated summary (only the appended bytes are read: none),
* the summary after 1% more records were appended,
* the budget-prefix selection and estimate over all records.

    .venv/bin/python benchmarks/bench_status.py [--records N] [--response-chars C]
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
from pathlib import Path

from eagle3data.atomic import dumps_line
from eagle3data.monitor.progress import dataset_progress, journal_summary


def _record(i: int, rng: random.Random, chars: int) -> dict:
    tokens = rng.randint(50, 2000)
    return {
        "id": f"p{i:08d}",
        "prompt_hash": f"{i:016x}",
        "status": "ok",
        "messages": [
            {"role": "user", "content": "question " * 20},
            {"role": "assistant", "content": "x" * chars},
        ],
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 60, "completion_tokens": tokens},
        "turns": [{"prompt_tokens": 60, "completion_tokens": tokens, "finish_reason": "stop"}],
        "finished_at": 1.8e9 + i,
    }


def _write(path: Path, start: int, stop: int, chars: int) -> None:
    rng = random.Random(start)
    with path.open("a") as fh:
        for i in range(start, stop):
            fh.write(dumps_line(_record(i, rng, chars)))


def _timed(label: str, fn):  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    result = fn()
    print(f"{label:<44} {time.perf_counter() - start:7.2f} s")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--response-chars", type=int, default=1000)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-status-"))
    try:
        journal = root / "A1" / "key.jsonl"
        journal.parent.mkdir()
        _write(journal, 0, args.records, args.response_chars)
        size = journal.stat().st_size
        print(f"journal: {args.records} records, {size / 1e9:.2f} GB")
        cache = root / "cache"
        summary = _timed(
            "first summary (parse all, write cache)", lambda: journal_summary(journal, cache)
        )
        _timed("repeated summary (cached, nothing new)", lambda: journal_summary(journal, cache))
        more = args.records // 100
        _write(journal, args.records, args.records + more, args.response_chars)
        summary = _timed(
            f"summary after {more} appended records", lambda: journal_summary(journal, cache)
        )
        order = summary["id"].to_list()
        hashes = summary["prompt_hash"].to_list()
        budget = int(summary["completion_tokens"].sum()) // 2
        progress = _timed(
            "budget prefix selection + estimate",
            lambda: dataset_progress(
                order, hashes, summary, token_budget=budget, max_samples=None, max_seq_len=4096
            ),
        )
        print(
            f"prefix: {progress.conversations} conversations, {progress.completion_tokens} tokens"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
