"""Wall time and peak memory of reading a large prompt source.

Generates, into a temporary folder (or --workdir, kept afterwards and reused), a ShareGPT
JSON Lines file of N short records (default 1,000,000: about 140 MB) and, with
--big-json-gb G, one JSON array of about G GB with OpenHermes-sized records (OpenHermes
2.5 ships a 1.9 GB array). Each target then runs on each source in a fresh child process
whose wall time and peak RSS are measured (os.wait4: that child's own rusage):

* baseline: the child only imports the modules (what the interpreter costs by itself);
* readers: iterating ``eagle3data.prompts.readers.iter_records`` over the source;
* stage: the prompts stage, ``eagle3data.prompts.stage.prepare_prompts`` in the sharegpt
  format, writing the prompts table and the skips into the work folder.

    .venv/bin/python benchmarks/bench_ingest.py                      # 1M records, both targets
    .venv/bin/python benchmarks/bench_ingest.py --big-json-gb 2 --target readers
    .venv/bin/python benchmarks/bench_ingest.py --records 20000      # a quick smoke run
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# --compare-src runs the stage of another checkout (e.g. the previous release) side by side.
sys.path.insert(0, os.environ.get("BENCH_SRC", str(REPO / "src")))

TARGETS = ("readers", "stage")
# Words of the generated texts: a small vocabulary, as the stage does not look at them.
_VOCABULARY = (
    "the model explain write code list how why what function data python error question "
    "answer short story summary translate French table number sort file test value input "
    "output example please simple step first second result compute average review email "
    "letter poem recipe history science math proof bug fix improve faster memory"
)
WORDS = _VOCABULARY.split()


# --- generated sources ------------------------------------------------------------------


def _words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(low, high)))


def _short_record(i: int, rng: random.Random) -> dict[str, Any]:
    """A short ShareGPT conversation (~100 bytes), unique by its index."""
    turns = [
        {"from": "human", "value": f"{_words(rng, 2, 5)} {i}?"},
        {"from": "gpt", "value": _words(rng, 2, 6)},
    ]
    if i % 10 == 0:
        turns.insert(0, {"from": "system", "value": "Be brief."})
    return {"id": f"s{i:08d}", "conversations": turns}


def _long_record(i: int, rng: random.Random) -> dict[str, Any]:
    """An OpenHermes-like record (~2 kB): null weights and ids, as that dataset has."""
    return {
        "conversations": [
            {"from": "system", "value": "You are a helpful assistant.", "weight": None},
            {"from": "human", "value": f"{_words(rng, 40, 120)} ({i})", "weight": None},
            {"from": "gpt", "value": _words(rng, 150, 350), "weight": 1.0},
        ],
        "source": "bench",
        "category": None,
        "id": None,
    }


def write_jsonl(path: Path, records: int) -> None:
    rng = random.Random(0)
    with path.open("w", encoding="utf-8") as fh:
        for i in range(records):
            fh.write(json.dumps(_short_record(i, rng), separators=(",", ":")) + "\n")


def write_json_array(path: Path, size_bytes: int) -> None:
    """One record per line inside one array, as json.dump writes big exports."""
    rng = random.Random(1)
    written = 0
    with path.open("w", encoding="utf-8") as fh:
        fh.write("[\n")
        i = 0
        while written < size_bytes:
            line = ("," if i else "") + json.dumps(_long_record(i, rng)) + "\n"
            fh.write(line)
            written += len(line)
            i += 1
        fh.write("]\n")


# --- the measured child ---------------------------------------------------------------------


def child(target: str, source: str, workdir: str) -> None:
    """Run one target in this process and print what it read as JSON."""
    from eagle3data.prompts.stage import prepare_prompts

    if target == "baseline":
        print(json.dumps({"records": 0}))
    elif target == "readers":
        from eagle3data.prompts.readers import RecordProblem, iter_records

        count = problems = 0
        for record in iter_records(source):
            count += 1
            problems += isinstance(record.value, RecordProblem)
        print(json.dumps({"records": count, "problems": problems}))
    else:
        out = Path(workdir) / f"prompts-{Path(source).name}.parquet"
        wanted = {
            "dataset": "bench",
            "source": source,
            "split": None,
            "fields": None,
            "fmt": "sharegpt",
            "on_invalid": "error",
            "min_valid_share": 0.5,
            "shuffle_seed": 0,
            "out_prompts": str(out),
            "out_skipped": str(out.with_suffix(".skipped.jsonl")),
            "out_images": str(out.with_suffix(".images.parquet")),
        }
        # The stage's signature changes with its features: pass what it accepts.
        accepted = inspect.signature(prepare_prompts).parameters
        prepare_prompts(**{k: v for k, v in wanted.items() if k in accepted})
        import pyarrow.parquet as pq

        print(json.dumps({"records": pq.ParquetFile(out).metadata.num_rows}))


@dataclass
class Run:
    target: str
    source: Path
    wall_s: float
    peak_rss_mb: float
    records: int | None
    error: str = ""


def measure(target: str, source: Path, workdir: Path, src: Path | None = None) -> Run:
    cmd = [sys.executable, __file__, "--child", target, str(source), str(workdir)]
    out, err = workdir / f"{target}.stdout", workdir / f"{target}.stderr"
    env = {**os.environ, "BENCH_SRC": str(src)} if src else None
    with out.open("w") as stdout, err.open("w") as stderr:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=env)
        # wait4, not wait: the rusage of this child alone (RUSAGE_CHILDREN is a max over all).
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    peak_mb = usage.ru_maxrss / 1024  # kilobytes on Linux
    if proc.returncode != 0:
        tail = err.read_text().strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return Run(target + _tag(src), source, wall, peak_mb, None, tail[0])
    records = json.loads(out.read_text().splitlines()[-1])["records"]
    return Run(target + _tag(src), source, wall, peak_mb, records)


def _tag(src: Path | None) -> str:
    return f" ({src})" if src else ""


# --- the report ---------------------------------------------------------------------------


def table(runs: list[Run], baseline_mb: float) -> Iterator[str]:
    yield (
        "| target | source | source MB | records | wall s | MB/s | peak RSS MB "
        "| over baseline MB | / source size |"
    )
    yield "|---|---|---|---|---|---|---|---|---|"
    for r in runs:
        size_mb = r.source.stat().st_size / 1e6
        over = r.peak_rss_mb - baseline_mb
        records = "failed: " + r.error if r.error else f"{r.records:,}"
        yield (
            f"| {r.target} | {r.source.name} | {size_mb:,.0f} | {records} | {r.wall_s:.1f} "
            f"| {size_mb / r.wall_s:.1f} | {r.peak_rss_mb:,.0f} | {over:,.0f} "
            f"| {over / size_mb:.2f} |"
        )


def prepare_sources(args: argparse.Namespace, workdir: Path) -> list[Path]:
    sources = []
    jsonl = workdir / f"sharegpt-{args.records}.jsonl"
    if not jsonl.exists():
        print(f"writing {jsonl} ...", flush=True)
        write_jsonl(jsonl, args.records)
    sources.append(jsonl)
    if args.big_json_gb:
        big = workdir / f"array-{args.big_json_gb:g}GB.json"
        if not big.exists():
            print(f"writing {big} ...", flush=True)
            write_json_array(big, int(args.big_json_gb * 1e9))
        sources.append(big)
    return sources


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000, help="JSONL records")
    parser.add_argument("--big-json-gb", type=float, default=0, help="also a JSON array")
    parser.add_argument(
        "--target", action="append", choices=TARGETS, help="repeatable; default: both"
    )
    parser.add_argument("--workdir", type=Path, help="keep (and reuse) the sources here")
    parser.add_argument(
        "--compare-src",
        type=Path,
        help="also run the stage on the JSON Lines source with this src/ folder (another "
        "checkout, e.g. `git worktree add /tmp/old HEAD~1` then /tmp/old/src)",
    )
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-ingest-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        sources = prepare_sources(args, workdir)
        baseline = measure("baseline", sources[0], workdir)
        if baseline.error:
            raise SystemExit(f"the baseline child failed: {baseline.error}")
        runs = [
            measure(target, source, workdir)
            for source in sources
            for target in args.target or TARGETS
        ]
        if args.compare_src:
            runs.append(measure("stage", sources[0], workdir, args.compare_src.resolve()))
        print(f"\nbaseline (imports only): peak RSS {baseline.peak_rss_mb:,.0f} MB\n")
        print("\n".join(table(runs, baseline.peak_rss_mb)))
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
