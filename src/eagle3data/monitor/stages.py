"""Which stage each dataset is at: the first whose outputs are missing or out of date.

"Out of date" is what makes Snakemake run a job again under the workflow's rerun
triggers (profiles/default): an output older than one of its inputs (mtime), or
the generate job's params changed (a budget or sample cap other than the one the
responses were written with). The draft vocabulary and the report are shared by all
datasets; a dataset is ``done`` only once they are newer than its own files.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..layout import (
    DRAFT_VOCAB,
    DRAFT_VOCAB_SUMMARY,
    MANIFEST,
    PROMPTS,
    REPORT_SUMMARY,
    RESPONSE_RECORDS,
    RESPONSE_STATS,
    RESPONSES,
    SHARD,
    SHARD_PLAN,
    SHARD_SPEC,
    SPECFORGE,
    TOKENIZE_STATS,
    TOKENIZED,
    Results,
)

STAGES = (
    "prompts",
    "generate",
    "tokenize",
    "hidden_states",
    "validate",
    "export",
    "draft_vocab",
    "report",
    "done",
)


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def fresh(outputs: Iterable[Path], inputs: Iterable[Path]) -> bool:
    """Whether every output exists and none is older than an existing input."""
    out_times = [_mtime(p) for p in outputs]
    if not out_times or any(t is None for t in out_times):
        return False
    in_times = [t for t in (_mtime(p) for p in inputs) if t is not None]
    return not in_times or min(out_times) >= max(in_times)  # type: ignore[type-var]


def responses_current(results: Results, dataset: str, ds_cfg: Mapping[str, Any]) -> bool:
    """Whether the responses were written under the dataset's current limits (a changed
    budget or sample cap re-runs the generate job, which then only rewrites them when
    the journal already decides the prefix)."""
    stats_file = results.path(RESPONSE_STATS, dataset=dataset)
    try:
        stats = json.loads(stats_file.read_text())
    except (OSError, ValueError):
        return False
    return (stats.get("token_budget"), stats.get("max_samples")) == (
        ds_cfg.get("token_budget"),
        ds_cfg.get("max_samples"),
    )


def dataset_stage(results: Results, dataset: str, config: Mapping[str, Any]) -> str:
    """The first of :data:`STAGES` that a run would still do for ``dataset``."""
    p = {
        name: results.path(pattern, dataset=dataset)
        for name, pattern in (
            ("prompts", PROMPTS),
            ("responses", RESPONSES),
            ("stats", RESPONSE_STATS),
            ("records", RESPONSE_RECORDS),
            ("tokenized", TOKENIZED),
            ("tokenize_stats", TOKENIZE_STATS),
            ("plan", SHARD_PLAN),
            ("manifest", MANIFEST),
        )
    }
    if not p["prompts"].exists():
        return "prompts"
    generated = [p["responses"], p["stats"], p["records"]]
    if not responses_current(results, dataset, config["datasets"][dataset]) or not fresh(
        generated, [p["prompts"]]
    ):
        return "generate"
    tokenized = [p["tokenized"], p["tokenize_stats"]]
    if not fresh(tokenized, [p["responses"]]):
        return "tokenize"
    if not fresh([p["plan"]], tokenized) or not _shards_fresh(results, dataset, p["plan"]):
        return "hidden_states"
    shards = results.shard_files(dataset)
    if not fresh([p["manifest"]], [*shards, p["plan"], p["responses"], *tokenized]):
        return "validate"
    if config.get("export", {}).get("specforge") and not fresh(
        [results.path(SPECFORGE, dataset=dataset)], [p["manifest"]]
    ):
        return "export"
    vocab = [results.path(DRAFT_VOCAB), results.path(DRAFT_VOCAB_SUMMARY)]
    if not fresh(vocab, [p["tokenized"]]):
        return "draft_vocab"
    report_inputs = [*generated, p["tokenize_stats"], p["plan"], p["manifest"]]
    if not fresh([results.path(REPORT_SUMMARY)], report_inputs):
        return "report"
    return "done"


def _shards_fresh(results: Results, dataset: str, plan_file: Path) -> bool:
    """Every planned shard exists and is not older than its spec (what re-runs a shard job:
    the plan and the tokenized table are ``ancient`` inputs of it)."""
    plan = json.loads(plan_file.read_text())
    return all(
        fresh(
            [results.path(SHARD, dataset=dataset, shard=s["shard"])],
            [results.path(SHARD_SPEC, dataset=dataset, shard=s["shard"])],
        )
        for s in plan["shards"]
    )


def stage_index(stage: str) -> int:
    return STAGES.index(stage)
