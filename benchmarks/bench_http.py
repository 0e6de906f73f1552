"""Throughput, client CPU and budget waste of the HTTP backend.

Runs the real generation driver and OpenAIEngine against tests/support/fake_openai.py
started as a separate process that simulates an SGLang engine with fixed capacity:
S concurrent slots generating R tokens/s each, requests beyond S queue (FIFO), a request
aborted by its rid leaves at once, a closed connection is noticed at SGLang's next check
(every ``--disconnect-check-s``, SGLang's 4 s), and the server counts every token it
decodes, cancelled work included (its ``/stats``).

    .venv/bin/python benchmarks/bench_http.py                 # prints a markdown table
    .venv/bin/python benchmarks/bench_http.py --concurrency 64 512 --slots 64 --tokens-per-s 200
    .venv/bin/python benchmarks/bench_http.py --lengths lognormal maxshare --policy queue tail
    .venv/bin/python benchmarks/bench_http.py --lengths lognormal maxshare --seeds 3

Completion lengths (``--lengths``, a hash of the prompt picks each one), with mean M:
- normal: M +- M/4, uniform (max_tokens 100,000: never reached);
- lognormal: log-normal, sigma 0.6, mean M, max_tokens 5 M;
- maxshare: a thinking model: 20% hit max_tokens (3 M), the rest log-normal (sigma 0.6)
  around M/2; mean M.
Policies (``--policy``), all in the same run for a before/after comparison:
- ``queue`` (today): the tail plan, following the server's queue through its gauge
  (``/v1/loads``): near the end, requests still waiting that the prefix will likely not need
  are aborted before they decode; cancelled requests are aborted by their rid;
- ``admit60``: ``queue`` as it was first built: a request admitted near the end when the
  prefix needs it with P >= 60% (``queue``: 80%), nothing cancelled while running before
  the prefix is decided (``queue``: those it will almost surely not need);
- ``tail``: the tail plan blind to the server's queue, cancelling by closing connections
  (the dispatch before the server's queue was followed);
- ``mean``: the dispatch before tail-aware planning (running mean throughout);
- the ablation of ``queue``, one change each: ``no-cancel`` (running requests are never
  cancelled before the prefix is decided: ``hopeless_in_flight`` off), ``no-queue`` (the
  server's queue gauge not read: nothing given back from its queue, token clocks from the
  send) and ``no-abort`` (cancelled requests are dropped by closing the connection, which
  SGLang notices at its next check, instead of an abort by rid).

Reported per length distribution, client concurrency and policy, all in the same run:
- capacity ratio: completion tokens the server delivered per second of the run,
  divided by S x R; "steady" excludes the final drain (from the moment dispatch
  stopped to the end), which no client can fill once the budget is reached;
- client CPU per request (process time of this client / requests completed);
- waste as the engine spent it: what the server decoded (its counter, cancelled work
  included) minus the completion tokens kept, as a share of the budget; and the waste our
  stats count (``waste_tokens``; the part of it estimated, not reported by the server);
- throughput relative to the same policy at concurrency equal to the slots.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import math
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from eagle3data.generation import budget as budget_rules  # noqa: E402
from eagle3data.generation import run as run_module  # noqa: E402
from eagle3data.generation.driver import GenerationJob, Prompt, run_generation  # noqa: E402
from eagle3data.generation.engines.openai_engine import HttpSettings, OpenAIEngine  # noqa: E402
from eagle3data.prompts.sources import prompt_hash  # noqa: E402

BASE_SAMPLING = {
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": -1,
    "repetition_penalty": 1.0,
    "stop": [],
}
LENGTHS = ("normal", "lognormal", "maxshare")
SIGMA = 0.6
MAX_SHARE = 0.2


def max_tokens(lengths: str, mean: int) -> int:
    return {"normal": 100_000, "lognormal": 5 * mean, "maxshare": 3 * mean}[lengths]


def sampling(lengths: str, mean: int) -> dict:
    return {**BASE_SAMPLING, "max_tokens": max_tokens(lengths, mean)}


def _unit(text: str, salt: str) -> float:
    """A number in (0, 1) from a hash: the same prompt always gets the same length."""
    digest = hashlib.sha256(f"{salt}\0{text}".encode()).digest()
    return (int.from_bytes(digest[:8], "big") + 0.5) / 2**64


def _lognormal(text: str, mean: float) -> int:
    mu = math.log(mean) - SIGMA**2 / 2
    return max(1, round(math.exp(mu + SIGMA * statistics.NormalDist().inv_cdf(_unit(text, "n")))))


def completion_tokens(lengths: str, text: str, mean: int) -> int:
    """Tokens the simulated engine would generate for a prompt, before max_tokens."""
    if lengths == "lognormal":
        return _lognormal(text, mean)
    if _unit(text, "cap") < MAX_SHARE:
        return 10**9  # cut at max_tokens (finish_reason "length")
    return _lognormal(text, (1 - MAX_SHARE * 3) / (1 - MAX_SHARE) * mean)


def serve(args: argparse.Namespace) -> None:
    """``--serve``: the fake engine with the chosen length distribution (a subprocess)."""
    sys.path.insert(0, str(REPO / "tests" / "support"))
    import fake_openai

    tokens_fn = None
    if args.lengths[0] != "normal":

        def tokens_fn(messages: list) -> int:
            text = fake_openai.last_user_text(messages)
            return completion_tokens(args.lengths[0], text, args.mean_tokens)

    async def run() -> None:
        server = fake_openai.FakeOpenAI(
            model="bench",
            mean_tokens=args.mean_tokens,
            tokens_fn=tokens_fn,
            slots=args.slots,
            tokens_per_s=args.tokens_per_s,
            disconnect_check_s=args.disconnect_check_s,
        )
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        print(f"READY {await server.start(0)}", flush=True)
        await stop.wait()
        await server.stop()

    fake_openai._raise_fd_limit()
    asyncio.run(run())


def start_server(args: argparse.Namespace, lengths: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            __file__,
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
            str(args.disconnect_check_s),
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


def prompt_text(i: int, seed: int) -> str:
    """The i-th prompt of a run; its hash is its completion's length, so each seed is
    another sequence of lengths (seed 0: the texts of the first version)."""
    return f"benchmark prompt {i}" if seed == 0 else f"benchmark prompt {seed}.{i}"


def run_once(url: str, concurrency: int, lengths: str, policy: str, seed: int, args) -> dict:
    budget = args.budget_factor * args.mean_tokens
    n_prompts = int(budget / args.mean_tokens * 1.5) + concurrency
    prompts = []
    for i in range(n_prompts):
        messages = [{"role": "user", "content": prompt_text(i, seed)}]
        prompts.append(Prompt(f"b{i:06d}", prompt_hash(messages), messages))
    server_call(url, "/stats/reset", "POST")
    with tempfile.TemporaryDirectory() as tmp:
        job = GenerationJob(
            dataset="bench",
            prompts=prompts,
            journal=Path(tmp) / "journal.jsonl",
            model="bench",
            sampling=sampling(lengths, args.mean_tokens),
            token_budget=budget,
            progress_interval_s=3600,
        )
        settings = HttpSettings(endpoints=[url], model="bench", concurrency=concurrency)
        stopped_at: list[float] = []

        def factory() -> OpenAIEngine:
            blind = policy in ("tail", "mean")
            return _DispatchClock(
                settings,
                job.sampling,
                stopped_at,
                follow_queue=not blind and policy != "no-queue",
                abort=not blind and policy != "no-abort",
            )

        saved = run_module.MIN_FIT, budget_rules.Z_LIKELY, budget_rules.Z_ABANDON
        if policy == "mean":  # the dispatch before tail-aware planning
            run_module.MIN_FIT = 10**9
        if policy in ("admit60", "tail"):
            budget_rules.Z_LIKELY, budget_rules.Z_ABANDON = 0.25, -math.inf
        if policy == "no-cancel":
            budget_rules.Z_ABANDON = -math.inf
        try:
            cpu0, t0 = time.process_time(), time.perf_counter()
            result = run_generation(job, factory, streaming=True)
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        finally:
            run_module.MIN_FIT, budget_rules.Z_LIKELY, budget_rules.Z_ABANDON = saved
    stats = _settled_stats(url, args.disconnect_check_s + 2.0)
    capacity = args.slots * args.tokens_per_s
    drain_start = stopped_at[0] - t0 if stopped_at else wall
    delivered = stats["completion_tokens"]
    return {
        "lengths": lengths,
        "policy": policy,
        "concurrency": concurrency,
        "budget": budget,
        "wall_s": wall,
        "ratio": delivered / wall / capacity,
        "ratio_before_drain": _ratio_before_drain(stats, capacity, drain_start, wall),
        "requests": stats["completed"],
        "cpu_ms_per_request": 1000 * cpu / max(stats["completed"], 1),
        "output_tokens": result.stats["completion_tokens"],
        "tokens_per_s": result.stats["completion_tokens"] / wall,
        "waste_pct": 100 * result.stats["waste_tokens"] / budget,
        "estimated_pct": 100 * result.stats["abandoned_tokens_estimated"] / budget,
        "engine_waste_pct": 100
        * (stats["decoded_tokens"] - result.stats["completion_tokens"])
        / budget,
        "cancelled": stats["cancelled"] + stats["aborted"],
        "cancelled_before_decode": stats["cancelled_before_decode"],
        "over_budget": result.stats["completion_tokens"] > budget,
    }


def _settled_stats(url: str, limit_s: float) -> dict:
    """The server's counters once nothing is queued or decoding any more (a closed
    connection is noticed only at the server's next check)."""
    deadline = time.monotonic() + limit_s
    while True:
        stats = server_call(url, "/stats")
        if (stats["in_service"] == 0 and stats["queued"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


class _DispatchClock(OpenAIEngine):
    """Notes the last time the driver sent a new conversation (start of the drain);
    without ``follow_queue`` it reads no queue gauge, without ``abort`` it aborts nothing
    by rid (both off: the engine before either)."""

    def __init__(
        self,
        settings: HttpSettings,
        sampling: dict,
        stopped_at: list[float],
        *,
        follow_queue: bool,
        abort: bool,
    ) -> None:
        super().__init__(settings, sampling=sampling, seed=0)
        self._stopped_at = stopped_at
        self._follows_queue, self._aborts = follow_queue, abort

    async def start(self) -> None:
        await super().start()
        for endpoint in self.pool.endpoints:
            endpoint.abortable = endpoint.abortable and self._aborts
            if not self._follows_queue:
                endpoint.queue_gauge = None

    async def complete(self, messages):  # type: ignore[no-untyped-def]
        self._stopped_at[:] = [time.perf_counter()]
        return await super().complete(messages)


async def _minimal_client(
    url: str, concurrency: int, n: int, limit: int, seed: int
) -> tuple[int, float]:
    """The reference: one aiohttp session, a semaphore, no budget logic at all."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal tokens
        body = {
            "model": "bench",
            "messages": [{"role": "user", "content": prompt_text(i, seed)}],
            "max_tokens": limit,
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


def run_minimal(url: str, concurrency: int, n: int, lengths: str, seed: int, args) -> float:
    server_call(url, "/stats/reset", "POST")
    limit = max_tokens(lengths, args.mean_tokens)
    tokens, wall = asyncio.run(_minimal_client(url, concurrency, n, limit, seed))
    return tokens / wall / (args.slots * args.tokens_per_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--lengths", nargs="+", choices=LENGTHS, default=list(LENGTHS))
    parser.add_argument(
        "--policy",
        nargs="+",
        choices=["queue", "admit60", "tail", "mean", "no-cancel", "no-queue", "no-abort"],
        default=["queue", "admit60", "tail"],
    )
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--tokens-per-s", type=float, default=200.0)
    parser.add_argument("--mean-tokens", type=int, default=200)
    parser.add_argument("--budget-factor", type=int, default=1000)
    parser.add_argument("--disconnect-check-s", type=float, default=4.0)
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="runs per row, each on another sequence of lengths: a row gives their means "
        "(waste: and the range); the minimal client runs on the first",
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return
    logging.basicConfig(level=logging.WARNING)
    rows = []
    for lengths in args.lengths:
        proc, url = start_server(args, lengths)
        try:
            for c in args.concurrency:
                for policy in args.policy:
                    runs = [run_once(url, c, lengths, policy, s, args) for s in range(args.seeds)]
                    row = _mean_row(runs)
                    first = runs[0]
                    minimal = run_minimal(url, c, first["requests"], lengths, 0, args)
                    row["ours_per_minimal"] = first["ratio"] / minimal
                    rows.append(row)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print(
        f"simulated engine: {args.slots} slots x {args.tokens_per_s:g} tok/s = "
        f"{args.slots * args.tokens_per_s:g} tok/s; mean completion {args.mean_tokens} tokens; "
        f"budget {args.budget_factor} x mean; closed connections noticed every "
        f"{args.disconnect_check_s:g} s\n"
    )
    base = {
        (r["lengths"], r["policy"]): r["tokens_per_s"]
        for r in rows
        if r["concurrency"] == args.slots
    }
    print(
        "| lengths | policy | concurrency | wall s | throughput / same policy at "
        f"{args.slots} | ours / minimal client | engine waste % of budget | counted waste % "
        "(estimated) | cancelled (before decoding) | client CPU ms/request | over budget |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        same = base.get((r["lengths"], r["policy"]))
        relative = f"{r['tokens_per_s'] / same:.3f}" if same else "-"
        spread = r["engine_waste_range"]
        waste = f"{r['engine_waste_pct']:.2f}"
        if args.seeds > 1:
            waste += f" ({spread[0]:.2f}-{spread[1]:.2f})"
        print(
            f"| {r['lengths']} | {r['policy']} | {r['concurrency']} | {r['wall_s']:.1f} | "
            f"{relative} | {r['ours_per_minimal']:.3f} | "
            f"{waste} | {r['waste_pct']:.2f} ({r['estimated_pct']:.2f}) | "
            f"{r['cancelled']:.0f} ({r['cancelled_before_decode']:.0f}) | "
            f"{r['cpu_ms_per_request']:.2f} | {'YES' if r['over_budget'] else 'no'} |"
        )


def _mean_row(runs: list[dict]) -> dict:
    """The runs of one row: numbers averaged, the engine waste's range, over budget if any."""
    row = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, float | int) and not isinstance(value, bool) and key != "budget":
            row[key] = statistics.mean(r[key] for r in runs)
    waste = [r["engine_waste_pct"] for r in runs]
    row["engine_waste_range"] = (min(waste), max(waste))
    row["over_budget"] = any(r["over_budget"] for r in runs)
    return row


if __name__ == "__main__":
    main()
