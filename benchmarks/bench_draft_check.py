"""Does a draft trained on a run's shards beat the controls? The figures of BENCHMARKS.md.

Trains vLLM speculators' own ``Eagle3DraftModel`` (1 layer, sdpa, eager KL loss, our loop)
on a finished run's validated shards, against three controls (the same draft trained with
each position's aux states replaced by another position's, trained on states shifted one
position, and untrained), for several seeds, and prints per-seed and mean +- std step-1
agreement and acceptance length (chain of 3) on held-out conversations, the margins and
whether the check's criterion holds (:mod:`eagle3data.consumers.draft_check`). Optionally
repeats the trained and ``aux_shuffled`` drafts on a fraction of the training conversations,
to show how each, and the margin between them, depends on the data size.

    .venv/bin/python benchmarks/bench_draft_check.py RUN_DIR [--seeds 0 1 2] [--epochs 30]
        [--fractions 0.25 0.5 [--fractions-only]] [--threads 1] [--out summary.json]

RUN_DIR is a workflow directory whose ``results/`` are complete (``snakemake`` ended):
every ``results/hidden_states/*/manifest.json``, ``results/vocab/draft_vocab.pt`` and the
model of its ``config/config.yaml``.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time
from pathlib import Path

import torch
import yaml

from eagle3data.consumers.draft_check import (
    VARIANTS,
    DraftCheckSettings,
    conversation_keys,
    load_samples,
    run_draft_check,
    split_conversations,
)


def _row(label: str, values: list[float]) -> str:
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    per_seed = " ".join(f"{v:.3f}" for v in values)
    return f"| {label} | {per_seed} | {mean:.3f} +- {std:.3f} |"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=DraftCheckSettings.epochs)
    parser.add_argument("--lr", type=float, default=DraftCheckSettings.lr)
    parser.add_argument("--fractions", type=float, nargs="*", default=[])
    parser.add_argument(
        "--fractions-only", action="store_true", help="skip the comparison with the controls"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)

    run = args.run_dir
    config = yaml.safe_load((run / "config/config.yaml").read_text())
    model_dir = run / config["model"]["path"]
    shard_dirs = sorted(p.parent for p in (run / "results/hidden_states").glob("*/manifest.json"))
    layer_ids = json.loads((shard_dirs[0] / "manifest.json").read_text())["attrs"][
        "aux_hidden_states_indices"
    ]
    vocab = torch.load(run / "results/vocab/draft_vocab.pt", weights_only=True)
    samples = load_samples(shard_dirs)
    settings = DraftCheckSettings(seeds=tuple(args.seeds), epochs=args.epochs, lr=args.lr)

    summary: dict = {}
    if not args.fractions_only:
        start = time.monotonic()
        summary = run_draft_check(samples, model_dir, vocab, layer_ids, settings)
        summary["seconds"] = time.monotonic() - start
        print(
            f"\n{platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s), "
            f"{summary['conversations']} conversations ({summary['samples']} samples), "
            f"{summary['train_tokens']} training tokens, draft vocabulary "
            f"{summary['draft_vocab_size']} (training side), "
            f"{summary['seconds']:.0f} s"
        )
        print("\n| draft | per seed " + " ".join(str(s) for s in args.seeds) + " | mean +- std |")
        print("|---|---|---|")
        for metric in ("step1_agreement", "acceptance_length"):
            for variant in VARIANTS:
                values = [r["metrics"][metric] for r in summary["runs"] if r["variant"] == variant]
                print(_row(f"{variant}: {metric}", values))
        print("\nmargins (mean trained - mean control, min trained - max control, seed spread):")
        for key, value in summary["margins"].items():
            print(
                f"  {key}: {value['margin']:.3f}, worst {value['worst_margin']:.3f}"
                f" (spread {value['spread']:.3f})"
            )
        verdict = summary["criterion"]
        print(f"\ncriterion ({verdict['rule']}): {verdict['controls']}")
        print("holds" if verdict["passed"] else f"does not hold: {verdict['reason']}")

    if args.fractions:
        # The same held-out conversations, fewer training ones.
        keys = conversation_keys(samples)
        train_idx, held_idx = split_conversations(
            keys, settings.heldout_fraction, settings.split_seed
        )
        held_conversations = len({keys[i] for i in held_idx})
        summary["fractions"] = {}
        print(
            "\n| training conversations, draft | step-1 agreement per seed |"
            " acceptance length per seed |"
        )
        print("|---|---|---|")
        for fraction in args.fractions:
            # Whole conversations: the first of the training side's, in dataset order.
            train_keys = list(dict.fromkeys(keys[i] for i in train_idx))
            kept = set(train_keys[: max(1, round(fraction * len(train_keys)))])
            keep = [i for i in train_idx if keys[i] in kept]
            subset = [samples[i] for i in sorted(keep + held_idx)]
            # The split orders conversations by a hash of their keys: the held-out ones come
            # first in the subset too, and this fraction selects exactly them again.
            part = run_draft_check(
                subset,
                model_dir,
                vocab,
                layer_ids,
                DraftCheckSettings(
                    seeds=settings.seeds,
                    epochs=settings.epochs,
                    lr=settings.lr,
                    heldout_fraction=(held_conversations - 0.5) / (len(kept) + held_conversations),
                ),
                variants=("trained", "aux_shuffled"),
            )
            held_ids = set(part["heldout_ids"])
            same = held_ids == {samples[i].id for i in held_idx}
            summary["fractions"][str(fraction)] = part
            for variant in ("trained", "aux_shuffled"):
                runs = [r["metrics"] for r in part["runs"] if r["variant"] == variant]
                print(
                    f"| {len(kept)} of {len(train_keys)}"
                    f"{'' if same else ' (other held-out set)'}, {variant} | "
                    + " ".join(f"{m['step1_agreement']:.3f}" for m in runs)
                    + " | "
                    + " ".join(f"{m['acceptance_length']:.3f}" for m in runs)
                    + " |"
                )
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
