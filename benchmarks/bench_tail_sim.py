"""The budget's tail in the deterministic simulation, with its rules switched off one at a time.

    .venv/bin/python benchmarks/bench_tail_sim.py            # ~4 min, prints a markdown table
    .venv/bin/python benchmarks/bench_tail_sim.py --seeds 16 --kinds lognormal

The driver's own planning (``_Run.plan``, ``hopeless``, ``unneeded_waiting``) against the
event-driven engine of ``tests/unit/test_dispatch_tail.py`` (64 slots x 200 tokens/s, FIFO
queue beyond them, budget 1000 x the mean length), at 512 requests in flight (a queue of
448 on the server) and at 64. Variants, one change each from ``queue`` (today's):
``no-cancel`` (running requests never cancelled before the prefix is decided),
``no-queue`` (the server's queue not seen: nothing given back from it, token clocks from
the send, and no running request cancelled: the driver cancels those only where it sees
the queue, without which a waiting request's progress is unknown). Aborts by rid cannot be
told apart here (the simulated engine frees a cancelled request at once either way):
``bench_http.py --policy no-abort`` measures them.

Reported over seeds (each another sequence of lengths): engine waste (everything decoded
that is not kept, cancelled work included) as a share of the budget, mean and worst;
throughput against the same variant with 64 in flight (mean and worst); requests the tail
rule cancelled while running; requests admitted on a state on which the cancel rule cancels
them (churn: must be 0).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests" / "unit"))

import test_dispatch_tail as sim_module  # noqa: E402

VARIANTS = {
    "queue": {"follow_queue": True, "cancel_hopeless": True},
    "no-cancel": {"follow_queue": True, "cancel_hopeless": False},
    "no-queue": {"follow_queue": False, "cancel_hopeless": True},
}


def run(kind: str, seed: int, concurrency: int, variant: str) -> sim_module.SimResult:
    budget = int(1000 * sim_module.MEAN[kind])
    n = int(1.5 * budget / sim_module.MEAN[kind]) + concurrency
    lengths = sim_module.lengths_for(kind, n, seed)
    return sim_module.simulate(
        lengths,
        budget,
        max_tokens=sim_module.MAX_TOKENS[kind],
        concurrency=concurrency,
        **VARIANTS[variant],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=["lognormal", "maxshare"])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args()
    print(
        "| lengths | variant | in flight | engine waste % of budget, mean (worst) | throughput / "
        "same at 64, mean (worst) | cancelled running, mean | admitted then cancellable |"
    )
    print("|---|---|---|---|---|---|---|")
    for kind in args.kinds:
        for variant in args.variants:
            at_slots = [run(kind, s, sim_module.SLOTS, variant) for s in range(args.seeds)]
            for concurrency, runs in (
                (512, [run(kind, s, 512, variant) for s in range(args.seeds)]),
                (sim_module.SLOTS, at_slots),
            ):
                waste = [100 * r.engine_waste_share for r in runs]
                speed = [
                    (r.generated / r.wall) / (b.generated / b.wall)
                    for r, b in zip(runs, at_slots, strict=True)
                ]
                print(
                    f"| {kind} | {variant} | {concurrency} | {statistics.mean(waste):.2f} "
                    f"({max(waste):.2f}) | {statistics.mean(speed):.3f} ({min(speed):.3f}) | "
                    f"{statistics.mean(r.tail_cancelled for r in runs):.1f} | "
                    f"{sum(r.churned for r in runs)} |"
                )


if __name__ == "__main__":
    main()
