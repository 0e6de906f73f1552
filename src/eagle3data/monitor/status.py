"""``eagle3data-status``: where every dataset stands, from the files on disk.

Safe while a run is in progress: it only reads append-only journals and finished
outputs (and keeps a small summary cache of each journal under results/.work/status).
One row per dataset: stage, conversations and completion tokens against the budget,
waste, the current rate and ETA (from the journal's timestamps), errors and skips,
hidden-state shards and bytes. ``--json`` prints the same for scripts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import polars as pl

from ..config import load_config
from ..layout import (
    MANIFEST,
    PROMPTS,
    RESPONSE_STATS,
    SHARD,
    SHARD_PLAN,
    SKIPPED_PROMPTS,
    TOKENIZED,
    Results,
)
from ..units import duration, human_bytes
from .preview import estimate_from, generation_progress, model_bytes_per_token
from .progress import file_lines

RATE_WINDOW_S = 600.0  # the rate is measured over the last ten minutes


@dataclass(frozen=True)
class DatasetStatus:
    dataset: str
    stage: str  # prompts, generate, tokenize, hidden_states, validate, done
    prompts: int | None
    skipped_input: int
    failed: int
    conversations_done: int
    conversations_planned: int | None  # exact once the prefix is decided
    completion_tokens: int
    token_budget: int | None
    budget_used: float | None  # completion_tokens / token_budget
    waste_tokens: int
    tokens_per_s: float | None
    eta_s: float | None
    shards_done: int
    shards_planned: int | None
    bytes_on_disk: int
    bytes_estimated: int | None
    estimate_basis: str


def _rate(records: pl.DataFrame, now: float) -> float | None:
    """Completion tokens per second journaled over the last ``RATE_WINDOW_S``."""
    stamped = records.filter(pl.col("finished_at").is_not_null())
    if stamped.height == 0:
        return None
    start = max(now - RATE_WINDOW_S, float(stamped["finished_at"].min()))  # type: ignore[arg-type]
    if now <= start:
        return None
    # Strictly after the start: when the window opens at the first record, that record's
    # tokens were generated before it and would inflate the rate.
    recent = stamped.filter(pl.col("finished_at") > start)
    return float(recent["spent_tokens"].sum()) / (now - start)


def _stage(results: Results, dataset: str, ds_cfg: Mapping[str, Any]) -> str:
    stats_file = results.path(RESPONSE_STATS, dataset=dataset)
    if not results.path(PROMPTS, dataset=dataset).exists():
        return "prompts"
    if not stats_file.exists():
        return "generate"
    stats = json.loads(stats_file.read_text())
    if (stats.get("token_budget"), stats.get("max_samples")) != (
        ds_cfg.get("token_budget"),
        ds_cfg.get("max_samples"),
    ):
        return "generate"  # limits changed since the responses were written
    if not results.path(TOKENIZED, dataset=dataset).exists():
        return "tokenize"
    plan = results.path(SHARD_PLAN, dataset=dataset)
    if not plan.exists() or not _all_shards(results, dataset, plan):
        return "hidden_states"
    if not results.path(MANIFEST, dataset=dataset).exists():
        return "validate"
    return "done"


def _all_shards(results: Results, dataset: str, plan_file: Path) -> bool:
    plan = json.loads(plan_file.read_text())
    return all(
        results.path(SHARD, dataset=dataset, shard=s["shard"]).exists() for s in plan["shards"]
    )


def dataset_status(
    config: Mapping[str, Any], dataset: str, results: Results, now: float | None = None
) -> DatasetStatus:
    now = time.time() if now is None else now
    ds_cfg = config["datasets"][dataset]
    budget = ds_cfg.get("token_budget")
    progress = generation_progress(config, dataset, results)
    plan_file = results.path(SHARD_PLAN, dataset=dataset)
    shards_planned, bytes_estimated = None, None
    if plan_file.exists():
        plan = json.loads(plan_file.read_text())
        shards_planned, bytes_estimated = len(plan["shards"]), int(plan["estimated_bytes"])
    estimate = estimate_from(config, dataset, progress, model_bytes_per_token(config))
    if bytes_estimated is None:
        bytes_estimated = estimate.bytes
    shard_files = results.shard_files(dataset)
    rate = eta = None
    done = completion = waste = failed = 0
    planned = None
    if progress is not None:
        done, completion, failed = (
            progress.conversations,
            progress.completion_tokens,
            progress.failed,
        )
        waste = progress.generated_tokens - progress.completion_tokens
        planned = progress.expected_conversations if progress.basis != "nothing yet" else None
        if not progress.selection.complete:
            rate = _rate(progress.records, now)
            if rate and budget is not None:
                eta = max(budget - completion, 0) / rate
            elif rate and planned is not None and done:
                eta = (planned - done) * (completion / done) / rate
    return DatasetStatus(
        dataset=dataset,
        stage=_stage(results, dataset, ds_cfg),
        prompts=None if progress is None else progress.prompts,
        skipped_input=file_lines(results.path(SKIPPED_PROMPTS, dataset=dataset)),
        failed=failed,
        conversations_done=done,
        conversations_planned=planned,
        completion_tokens=completion,
        token_budget=budget,
        budget_used=None if not budget else completion / budget,
        waste_tokens=waste,
        tokens_per_s=rate,
        eta_s=eta,
        shards_done=len(shard_files),
        shards_planned=shards_planned,
        bytes_on_disk=sum(f.stat().st_size for f in shard_files),
        bytes_estimated=bytes_estimated,
        estimate_basis=estimate.basis if estimate.bytes_per_token else "unknown",
    )


def format_table(rows: Sequence[DatasetStatus]) -> str:
    header = (
        "dataset",
        "stage",
        "conversations",
        "completion tokens / budget",
        "waste",
        "tok/s",
        "ETA",
        "failed",
        "skipped",
        "shards",
        "hidden states on disk / est.",
    )
    lines = [header]
    for r in rows:
        convs = f"{r.conversations_done}/{r.conversations_planned or '?'}"
        if r.token_budget is None:
            tokens = f"{r.completion_tokens}/-"
        else:
            tokens = f"{r.completion_tokens}/{r.token_budget} ({100 * (r.budget_used or 0):.0f}%)"
        est = "?" if r.bytes_estimated is None else human_bytes(r.bytes_estimated)
        lines.append(
            (
                r.dataset,
                r.stage,
                convs,
                tokens,
                str(r.waste_tokens),
                "-" if r.tokens_per_s is None else f"{r.tokens_per_s:.0f}",
                duration(r.eta_s),
                str(r.failed),
                str(r.skipped_input),
                f"{r.shards_done}/{r.shards_planned if r.shards_planned is not None else '?'}",
                f"{human_bytes(r.bytes_on_disk)} / {est}",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eagle3data-status", description=__doc__.split("\n")[0])
    parser.add_argument("-d", "--directory", type=Path, default=Path("."), help="workflow dir")
    parser.add_argument("--config", type=Path, help="default: DIRECTORY/config/config.yaml")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    config_file = args.config or args.directory / "config" / "config.yaml"
    try:
        config = load_config(config_file)
    except Exception as exc:  # a config the workflow itself would refuse
        print(f"eagle3data-status: {config_file}: {exc}", file=sys.stderr)
        return 2
    if not Path(config["model"]["path"]).is_absolute():
        config["model"]["path"] = str(args.directory / config["model"]["path"])
    results = Results(args.directory)
    rows = [dataset_status(config, ds, results) for ds in config["datasets"]]
    if args.json:
        per_token = model_bytes_per_token(config)
        print(json.dumps({"bytes_per_token": per_token, "datasets": [asdict(r) for r in rows]}))
    else:
        print(format_table(rows))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
