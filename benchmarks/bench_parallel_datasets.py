"""Several datasets against one server: all at once sharing one concurrency, or one at a time.

Each dataset's generate job runs as a process of its own, as Snakemake runs it, through the
generate stage itself (``eagle3data.generation.stage.generate``: journal, budget, the
endpoint's shared slots under ``results/.work/endpoint-slots``), against the stand-in engine
of ``benchmarks/bench_http.py`` (a separate process: S slots decoding R tokens/s each,
SGLang's queue gauge and abort by rid, completion lengths from a hash of the prompt):

- ``one at a time``: the jobs run one after the other (the generate rule before, which took
  every core), each alone with the whole ``concurrency``;
- ``parallel``: the jobs start together (the rule now: one thread each) and share the
  endpoint's ``concurrency`` through its slots.

    .venv/bin/python benchmarks/bench_parallel_datasets.py            # ~5 min, a markdown table
    .venv/bin/python benchmarks/bench_parallel_datasets.py --datasets 9 --lengths maxshare

Reported per length distribution, both modes in the same run against the same server:
wall time from the first job's start to the last job's end (job starts, i.e. imports,
included), the same from the first request to the last answer, the server's delivered
completion tokens per second over S x R, the most requests it held at once (at most the
concurrency in both modes: the jobs share it), the engine's waste (decoded minus kept) as a
share of the budgets, when the first dataset was done, and whether every dataset's output is
byte-identical between the modes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

LENGTHS = ("normal", "lognormal", "maxshare")
BASE_SAMPLING = {
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": -1,
    "repetition_penalty": 1.0,
    "stop": [],
}
# bench_http.py's max_tokens per length distribution, as multiples of the mean.
MAX_TOKENS = {"normal": 100_000, "lognormal": 5, "maxshare": 3}


def start_server(args: argparse.Namespace, lengths: str) -> tuple[subprocess.Popen[str], str]:
    """bench_http.py's stand-in engine with this length distribution."""
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "benchmarks" / "bench_http.py"),
            "--serve",
            "--lengths",
            lengths,
            "--slots",
            str(args.slots),
            "--tokens-per-s",
            str(args.tokens_per_s),
            "--mean-tokens",
            str(args.mean_tokens),
            "--disconnect-check-s",
            "4",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line.startswith("READY "):
        proc.kill()
        raise SystemExit(f"fake server did not start: {line!r}")
    return proc, line.split()[1]


def server_call(url: str, path: str, method: str = "GET") -> dict[str, Any]:
    req = urllib.request.Request(
        url.removesuffix("/v1") + path, method=method, data=b"" if method == "POST" else None
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read() or b"{}")


def settled_stats(url: str) -> dict[str, Any]:
    """The server's counters once nothing decodes any more (a closed connection is
    noticed at its next 4 s check)."""
    deadline = time.monotonic() + 6
    while True:
        stats = server_call(url, "/stats")
        if (stats["in_service"] == 0 and stats["queued"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def write_datasets(root: Path, url: str, args: argparse.Namespace, lengths: str) -> list[dict]:
    """Each dataset's prompts (its name in every prompt: other texts, other lengths) and the
    arguments the generate rule passes the stage."""
    from eagle3data.prompts.sources import Conversation, prompt_hash
    from eagle3data.prompts.table import write_prompts

    model = root / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    budget = args.budget_factor * args.mean_tokens
    n_prompts = int(args.budget_factor * 1.5) + args.concurrency
    jobs = []
    for d in range(args.datasets):
        name = f"D{d}"
        conversations = []
        for i in range(n_prompts):
            messages = [{"role": "user", "content": f"benchmark prompt {name}.{i}"}]
            conversations.append(
                Conversation(f"{name}-{i:06d}", messages, None, prompt_hash(messages))
            )
        paths = {
            "prompts_path": f"results/prompts/{name}.parquet",
            "skipped_path": f"results/prompts/{name}.skipped.jsonl",
            "out_responses": f"results/responses/{name}.jsonl",
            "out_stats": f"results/responses/{name}.stats.json",
            "out_errors": f"results/responses/{name}.errors.jsonl",
            "out_records": f"results/responses/{name}.records.parquet",
        }
        for path in paths.values():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
        write_prompts(root / paths["prompts_path"], conversations)
        (root / paths["skipped_path"]).write_text("")
        max_tokens = MAX_TOKENS[lengths] * (1 if lengths == "normal" else args.mean_tokens)
        jobs.append(
            {
                "dataset": name,
                "settings": {
                    "model": "bench",
                    "model_path": str(model),
                    "dtype": "auto",
                    "chat_template_kwargs": {},
                    "backend": "openai",
                    "seed": 0,
                    "sampling": {**BASE_SAMPLING, "max_tokens": max_tokens},
                    "served_model": "bench",
                    "extra_body": {},
                },
                "execution": {
                    "device": "auto",
                    "endpoints": [url],
                    "api_key_env": None,
                    "concurrency": args.concurrency,
                    "request_timeout_s": 600,
                    "max_retries": 4,
                    "max_consecutive_failures": 20,
                    "max_error_rate": 0.5,
                    "progress_interval_s": 3600,
                    "return_token_ids": True,
                    "trust_remote_code": False,
                },
                "token_budget": budget,
                "max_samples": None,
                **paths,
            }
        )
    return jobs


def run_job(root: str, arguments: str) -> None:
    """``--job``: one dataset's generate job in this process; prints when it generated."""
    os.chdir(root)
    from eagle3data.generation.settings import GenerationSettings
    from eagle3data.generation.stage import generate
    from eagle3data.layout import Results

    job = json.loads(arguments)
    settings = GenerationSettings.parse(job.pop("settings"), job.pop("execution"))
    start = time.monotonic()
    generate(results=Results(Path(root)), settings=settings, **job)
    print(json.dumps({"start": start, "end": time.monotonic()}), flush=True)


def start_job(root: Path, job: dict) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, "--job", str(root), json.dumps(job)],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_job(proc: subprocess.Popen[str]) -> dict[str, float]:
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"a generate job failed:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def run_mode(mode: str, url: str, args: argparse.Namespace, lengths: str, tmp: Path) -> dict:
    root = tmp / mode
    jobs = write_datasets(root, url, args, lengths)
    server_call(url, "/stats/reset", "POST")
    t0 = time.monotonic()
    if mode == "parallel":
        procs = [start_job(root, job) for job in jobs]
        times = [wait_job(p) for p in procs]
    else:
        times = [wait_job(start_job(root, job)) for job in jobs]
    wall = time.monotonic() - t0
    stats = settled_stats(url)
    kept = 0
    outputs = {}
    for job in jobs:
        kept += json.loads((root / job["out_stats"]).read_text())["completion_tokens"]
        outputs[job["dataset"]] = (root / job["out_responses"]).read_bytes()
    generating = (
        max(t["end"] for t in times) - min(t["start"] for t in times)
        if mode == "parallel"
        else sum(t["end"] - t["start"] for t in times)
    )
    budget = args.budget_factor * args.mean_tokens * args.datasets
    return {
        "first_done_s": min(t["end"] for t in times) - t0,
        "wall_s": wall,
        "generating_s": generating,
        "capacity_ratio": stats["completion_tokens"] / wall / (args.slots * args.tokens_per_s),
        "peak": stats["max_in_service"] + stats["max_queued"],
        "engine_waste_pct": 100 * (stats["decoded_tokens"] - kept) / budget,
        "outputs": outputs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", type=int, default=4)
    parser.add_argument("--lengths", nargs="+", choices=LENGTHS, default=list(LENGTHS))
    parser.add_argument("--concurrency", type=int, default=64, help="generation.concurrency")
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--tokens-per-s", type=float, default=200.0)
    parser.add_argument("--mean-tokens", type=int, default=200)
    parser.add_argument("--budget-factor", type=int, default=300, help="budget / mean length")
    parser.add_argument("--job", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        run_job(*args.job)
        return
    print(
        f"{args.datasets} datasets, budget {args.budget_factor} x {args.mean_tokens} tokens each, "
        f"concurrency {args.concurrency}, {args.slots} slots x {args.tokens_per_s:.0f} tokens/s"
    )
    print(
        "| lengths | mode | wall s (job starts included) | generating s | capacity ratio "
        "| most requests at once | engine waste % of budgets | first dataset done s "
        "| wall / parallel |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for lengths in args.lengths:
        server, url = start_server(args, lengths)
        tmp = Path(tempfile.mkdtemp(prefix="bench-parallel-"))
        try:
            rows = {
                mode: run_mode(mode, url, args, lengths, tmp)
                for mode in ("one at a time", "parallel")
            }
        finally:
            server.terminate()
            server.wait()
            shutil.rmtree(tmp, ignore_errors=True)
        same = rows["one at a time"]["outputs"] == rows["parallel"]["outputs"]
        for mode, row in rows.items():
            print(
                f"| {lengths} | {mode} | {row['wall_s']:.1f} | {row['generating_s']:.1f} "
                f"| {row['capacity_ratio']:.3f} | {row['peak']} | {row['engine_waste_pct']:.2f} "
                f"| {row['first_done_s']:.1f} | {row['wall_s'] / rows['parallel']['wall_s']:.2f} |",
                flush=True,
            )
        print(f"<!-- {lengths}: outputs identical in both modes: {same} -->", flush=True)


if __name__ == "__main__":
    main()
