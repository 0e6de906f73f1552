"""Throughput, client CPU and budget waste of the HTTP backend.

Runs the real generation driver and OpenAIEngine against tests/support/fake_openai.py
started as a separate process that simulates an engine with fixed capacity:
S concurrent slots generating R tokens/s each, requests beyond S queue (FIFO),
a closed connection frees its slot (as SGLang aborts such a request).

    .venv/bin/python benchmarks/bench_http.py                 # prints a markdown table
    .venv/bin/python benchmarks/bench_http.py --concurrency 64 512 --slots 64 --tokens-per-s 200

Reported per client concurrency, all measured in the same run:
- capacity ratio: completion tokens the server delivered per second of the run,
  divided by S x R; "steady" excludes the final drain (from the moment dispatch
  stopped to the end), which no client can fill once the budget is reached;
- client CPU per request (process time of this client / requests completed);
- waste: completion tokens received but outside the budget prefix, as a share of
  the budget, plus requests cancelled in flight when the prefix was decided.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from eagle3data.generation.driver import GenerationJob, Prompt, run_generation  # noqa: E402
from eagle3data.generation.engines.openai_engine import HttpSettings, OpenAIEngine  # noqa: E402
from eagle3data.prompts.sources import prompt_hash  # noqa: E402

SAMPLING = {
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": -1,
    "max_tokens": 100_000,
    "repetition_penalty": 1.0,
    "stop": [],
}


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "tests" / "support" / "fake_openai.py"),
            "--port",
            "0",
            "--model",
            "bench",
            "--slots",
            str(args.slots),
            "--tokens-per-s",
            str(args.tokens_per_s),
            "--mean-tokens",
            str(args.mean_tokens),
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


def server_call(url: str, path: str, method: str = "GET") -> dict:
    base = url.removesuffix("/v1")
    req = urllib.request.Request(base + path, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read() or b"{}")


def _ratio_before_drain(stats: dict, capacity: float, drain_start: float, wall: float) -> float:
    """Delivered tokens minus those the drain could hold, over the time before it."""
    drain = wall - drain_start
    return (stats["completion_tokens"] - drain * capacity) / capacity / max(drain_start, 1e-9)


def run_once(url: str, concurrency: int, args: argparse.Namespace) -> dict:
    budget = args.budget_factor * args.mean_tokens
    n_prompts = int(budget / args.mean_tokens * 1.5) + concurrency
    prompts = []
    for i in range(n_prompts):
        messages = [{"role": "user", "content": f"benchmark prompt {i}"}]
        prompts.append(Prompt(f"b{i:06d}", prompt_hash(messages), messages))
    server_call(url, "/stats/reset", "POST")
    with tempfile.TemporaryDirectory() as tmp:
        job = GenerationJob(
            dataset="bench",
            prompts=prompts,
            journal=Path(tmp) / "journal.jsonl",
            model="bench",
            sampling=SAMPLING,
            token_budget=budget,
            progress_interval_s=3600,
        )
        settings = HttpSettings(endpoints=[url], model="bench", concurrency=concurrency)
        stopped_at: list[float] = []

        def factory() -> OpenAIEngine:
            return _DispatchClock(settings, stopped_at)

        cpu0, t0 = time.process_time(), time.perf_counter()
        result = run_generation(job, factory, streaming=True)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    time.sleep(0.5)  # let the server count the cancelled requests
    stats = server_call(url, "/stats")
    capacity = args.slots * args.tokens_per_s
    drain_start = stopped_at[0] - t0 if stopped_at else wall
    delivered = stats["completion_tokens"]
    return {
        "concurrency": concurrency,
        "budget": budget,
        "wall_s": wall,
        "ratio": delivered / wall / capacity,
        "ratio_before_drain": _ratio_before_drain(stats, capacity, drain_start, wall),
        "requests": stats["completed"],
        "cpu_ms_per_request": 1000 * cpu / max(stats["completed"], 1),
        "output_tokens": result.stats["completion_tokens"],
        "waste_pct": 100 * result.stats["waste_tokens"] / budget,
        "cancelled": stats["cancelled"],
        "over_budget": result.stats["completion_tokens"] > budget,
    }


class _DispatchClock(OpenAIEngine):
    """Notes the last time the driver sent a new conversation (start of the drain)."""

    def __init__(self, settings: HttpSettings, stopped_at: list[float]) -> None:
        super().__init__(settings, sampling=SAMPLING, seed=0)
        self._stopped_at = stopped_at

    async def complete(self, messages):  # type: ignore[no-untyped-def]
        self._stopped_at[:] = [time.perf_counter()]
        return await super().complete(messages)


async def _minimal_client(url: str, concurrency: int, n: int) -> tuple[int, float]:
    """The reference: one aiohttp session, a semaphore, no budget logic at all."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal tokens
        body = {
            "model": "bench",
            "messages": [{"role": "user", "content": f"benchmark prompt {i}"}],
            "max_tokens": SAMPLING["max_tokens"],
            "temperature": 0.0,
        }
        async with sem, session.post(f"{url}/chat/completions", json=body) as resp:
            tokens += (await resp.json())["usage"]["completion_tokens"]

    timeout = aiohttp.ClientTimeout(total=3600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(session, i) for i in range(n)))
        return tokens, time.perf_counter() - t0


def run_minimal(url: str, concurrency: int, n: int, args: argparse.Namespace) -> float:
    server_call(url, "/stats/reset", "POST")
    tokens, wall = asyncio.run(_minimal_client(url, concurrency, n))
    return tokens / wall / (args.slots * args.tokens_per_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--tokens-per-s", type=float, default=200.0)
    parser.add_argument("--mean-tokens", type=int, default=200)
    parser.add_argument("--budget-factor", type=int, default=1000)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    proc, url = start_server(args)
    try:
        rows = []
        for c in args.concurrency:
            row = run_once(url, c, args)
            row["minimal_ratio"] = run_minimal(url, c, row["requests"], args)
            rows.append(row)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(
        f"simulated engine: {args.slots} slots x {args.tokens_per_s:g} tok/s = "
        f"{args.slots * args.tokens_per_s:g} tok/s; mean completion {args.mean_tokens} tokens; "
        f"budget {args.budget_factor} x mean\n"
    )
    print(
        "| concurrency | wall s | capacity ratio | minimal client, same requests | ours / minimal "
        "| client CPU ms/request | waste % of budget | cancelled in flight | over budget |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['concurrency']} | {r['wall_s']:.1f} | {r['ratio']:.3f} | "
            f"{r['minimal_ratio']:.3f} | {r['ratio'] / r['minimal_ratio']:.3f} | "
            f"{r['cpu_ms_per_request']:.2f} | {r['waste_pct']:.2f} | {r['cancelled']} | "
            f"{'YES' if r['over_budget'] else 'no'} |"
        )


if __name__ == "__main__":
    main()
