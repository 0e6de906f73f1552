"""Budget waste on the real SGLang and vLLM CPU servers of the test suite, from their counters.

    bash tests/sglang/setup.sh
    .venv-sglang/bin/python benchmarks/bench_real_waste.py --engine sglang   # ~7 min
    bash tests/vllm/setup.sh
    .venv/bin/python benchmarks/bench_real_waste.py --engine vllm   # ~4 min

A tiny random Qwen3 (the suite's) served on CPU with 4 decode slots
(``--max-running-requests`` / ``--max-num-seqs``); the real generation driver and
``OpenAIEngine`` run a budgeted dataset against it at concurrency 4 (= the slots) and 16 (a
server-side queue), following the server's queue (``queue``: today's engine) or blind to it
and cancelling by closing connections (``blind``: the engine before the server's queue was
followed); and the ablation of ``queue``, one change each: ``no-queue`` (its queue gauge not
read), ``no-abort`` (no abort by rid: SGLang's closed-connection check instead),
``no-cancel`` (running requests not cancelled before the prefix is decided). SGLang keeps its
default 4 s check for closed connections.

Waste "as the server spent it" is the growth of the server's own generated-token counter
(``sglang:generation_tokens_total``, ``vllm:generation_tokens_total``) over the run, once
nothing is left running on it, minus the completion tokens kept; beside it, what our stats
count (``waste_tokens``) and the part of that which is estimated (no server report).

Lengths: a random model almost never ends its turn, so it samples at temperature 1 (close
to uniform over the vocabulary), a seed per prompt, with a stop string (``--stop``, default
``x``): lengths then spread geometrically, long-tailed, up to ``--max-tokens``.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))

from eagle3data.generation import budget as budget_rules  # noqa: E402
from eagle3data.generation.driver import GenerationJob, Prompt, run_generation  # noqa: E402
from eagle3data.generation.engines.openai_engine import HttpSettings, OpenAIEngine  # noqa: E402
from eagle3data.prompts.sources import prompt_hash  # noqa: E402

SLOTS = 4
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0}
COUNTER = {"sglang": "sglang:generation_tokens_total", "vllm": "vllm:generation_tokens_total"}
RUNNING = {
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting"),
}


def start_server(engine: str, model_dir: Path, log: Path):  # type: ignore[no-untyped-def]
    if engine == "sglang":
        from support.sglang_server import SGLangServer

        # SGLang's own 4 s check for dropped connections (the suite shortens it to 1 s).
        return SGLangServer(
            model_dir,
            log_path=log,
            extra_args=("--max-running-requests", str(SLOTS)),
            request_state_wait_timeout_s=None,
        )
    from support.vllm_server import VLLMServer

    return VLLMServer(model_dir, log_path=log, max_num_seqs=SLOTS)


def settled(server, engine: str, limit_s: float = 15.0) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """The server's metrics once nothing runs or waits on it any more (a dropped connection
    is noticed at the server's next check; SGLang counts a request's tokens when it ends)."""
    deadline = time.monotonic() + limit_s
    while True:
        metrics = server.metrics()
        busy = sum(metrics.get(name, 0.0) for name in RUNNING[engine])
        if busy == 0 or time.monotonic() > deadline:
            time.sleep(0.5)  # the counter is updated after the gauges
            return server.metrics()
        time.sleep(0.2)


class _PerPromptSeed(OpenAIEngine):
    """A sampling seed per prompt (a hash of its text): the engine sends its one seed with
    every request, and vLLM then draws the same tokens from a random model's nearly flat
    distribution whatever the prompt, so every answer would have the same length."""

    async def complete(self, messages, tools=None):  # type: ignore[no-untyped-def]
        text = str(messages[-1]["content"]).encode()
        # request_body reads self.seed before complete's first await.
        self.seed = int.from_bytes(hashlib.sha256(text).digest()[:4], "big")
        return await super().complete(messages, tools)


class _Ablated(_PerPromptSeed):
    """Without the queue gauge (``follow_queue``) or the abort by rid (``abort``)."""

    follow_queue, abort = True, True

    async def start(self) -> None:
        await super().start()
        for endpoint in self.pool.endpoints:
            endpoint.abortable = endpoint.abortable and self.abort
            if not self.follow_queue:
                endpoint.queue_gauge = None


class _Blind(_Ablated):
    """The engine before the server's queue was followed: no gauge, no abort by rid."""

    follow_queue, abort = False, False


class _NoQueue(_Ablated):
    follow_queue = False


class _NoAbort(_Ablated):
    abort = False


ENGINES = {
    "queue": _PerPromptSeed,
    "blind": _Blind,
    "no-queue": _NoQueue,
    "no-abort": _NoAbort,
    "no-cancel": _PerPromptSeed,
}


def run_once(server, engine: str, args, concurrency: int, policy: str, seed: int) -> dict:  # type: ignore[no-untyped-def]
    prompts = []
    for i in range(args.prompts):
        messages = [{"role": "user", "content": f"Story {seed}.{i}, please."}]
        prompts.append(Prompt(f"r{i:04d}", prompt_hash(messages), messages))
    sampling = {**SAMPLING, "max_tokens": args.max_tokens, "stop": [args.stop]}
    before = settled(server, engine).get(COUNTER[engine], 0.0)
    with tempfile.TemporaryDirectory() as tmp:
        job = GenerationJob(
            dataset="bench",
            prompts=prompts,
            journal=Path(tmp) / "journal.jsonl",
            model=server.model_name,
            sampling=sampling,
            token_budget=args.budget,
            progress_interval_s=3600,
        )
        settings = HttpSettings(
            endpoints=[server.url], model=server.model_name, concurrency=concurrency
        )
        kind = ENGINES[policy]

        engines: list[OpenAIEngine] = []

        def factory() -> OpenAIEngine:
            engines.append(kind(settings, sampling=sampling, seed=0))
            return engines[-1]

        saved = budget_rules.Z_ABANDON
        if policy == "no-cancel":
            budget_rules.Z_ABANDON = -math.inf
        try:
            t0 = time.perf_counter()
            result = run_generation(job, factory, streaming=True)
            wall = time.perf_counter() - t0
        finally:
            budget_rules.Z_ABANDON = saved
    decoded = settled(server, engine).get(COUNTER[engine], 0.0) - before
    kept = result.stats["completion_tokens"]
    lengths = [row["usage"]["completion_tokens"] for row in result.rows]
    return {
        "mean_length": sum(lengths) / len(lengths),
        "at_max_pct": 100 * sum(n >= args.max_tokens for n in lengths) / len(lengths),
        "concurrency": concurrency,
        "policy": policy,
        "seed": seed,
        "wall_s": wall,
        "kept": kept,
        "kept_per_s": kept / wall,
        "server_decoded": decoded,
        "server_waste_pct": 100 * (decoded - kept) / args.budget,
        "counted_waste_pct": 100 * result.stats["waste_tokens"] / args.budget,
        "estimated_pct": 100 * result.stats["abandoned_tokens_estimated"] / args.budget,
        "cancelled": result.stats["abandoned_requests"],
        "gauge_readings": sum(e.gauge_readings for e in engines),
        "over_budget": kept > args.budget,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=sorted(COUNTER), required=True)
    parser.add_argument("--prompts", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--stop", default="x")
    parser.add_argument("--budget", type=int, default=10_000)
    parser.add_argument("--seeds", type=int, default=2, help="prompt sets per row")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[SLOTS, 4 * SLOTS])
    parser.add_argument("--policy", nargs="+", choices=sorted(ENGINES), default=["queue", "blind"])
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from support.target_models import make_qwen3_dir

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        # vLLM's CPU attention runs head sizes of 32 and up (tests/support/target_models.py).
        model_dir = make_qwen3_dir(
            Path(tmp) / "qwen3", head_dim=32 if args.engine == "vllm" else 16
        )
        with start_server(args.engine, model_dir, Path(tmp) / "server.log") as server:
            print(f"{args.engine} server ready in {server.startup_s:.0f} s", file=sys.stderr)
            for seed in range(args.seeds):
                for concurrency in args.concurrency:
                    # The order alternates from prompt set to prompt set: the machine's
                    # drift (its other load, the server's warm-up) falls on each side alike.
                    order = args.policy if seed % 2 == 0 else args.policy[::-1]
                    for policy in order:
                        row = run_once(server, args.engine, args, concurrency, policy, seed)
                        print(row, file=sys.stderr, flush=True)
                        rows.append(row)
    print(
        f"{args.engine}, {SLOTS} slots, budget {args.budget} tokens, max_tokens "
        f"{args.max_tokens}, {args.seeds} prompt sets per row (means; waste: and range)\n"
    )
    print(
        "| policy | concurrency | wall s | kept tokens/s | answer tokens, mean (% at max) | "
        "server decoded | server waste % of budget | counted waste % (estimated) | cancelled | "
        f"gauge readings | kept tokens/s / {args.policy[0]}'s, same prompt set: mean (range) | "
        "over budget |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for concurrency in args.concurrency:
        for policy in args.policy:
            runs = [r for r in rows if (r["concurrency"], r["policy"]) == (concurrency, policy)]
            waste = [r["server_waste_pct"] for r in runs]

            def mean(key: str, runs: list[dict] = runs) -> float:
                return sum(r[key] for r in runs) / len(runs)

            # Paired by prompt set: one set's answers run 20% faster than another's on the
            # 2-core machine, more than the policies differ.
            first = {
                r["seed"]: r["kept_per_s"]
                for r in rows
                if (r["concurrency"], r["policy"]) == (concurrency, args.policy[0])
            }
            ratios = [r["kept_per_s"] / first[r["seed"]] for r in runs]

            print(
                f"| {policy} | {concurrency} | {mean('wall_s'):.1f} | {mean('kept_per_s'):.0f} | "
                f"{mean('mean_length'):.0f} ({mean('at_max_pct'):.0f}%) | "
                f"{mean('server_decoded'):.0f} | {mean('server_waste_pct'):.2f} "
                f"({min(waste):.2f}-{max(waste):.2f}) | {mean('counted_waste_pct'):.2f} "
                f"({mean('estimated_pct'):.2f}) | {mean('cancelled'):.1f} | "
                f"{mean('gauge_readings'):.0f} | {sum(ratios) / len(ratios):.3f} "
                f"({min(ratios):.3f}-{max(ratios):.3f}) | "
                f"{'YES' if any(r['over_budget'] for r in runs) else 'no'} |"
            )


if __name__ == "__main__":
    main()
