"""What the report shows, read from a run's files: completion lengths, budget use and waste,
truncation, throughput over time from the journals, tokens per shard; one
:class:`DatasetReport` per dataset."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from ..generation.records import SUMMARY_SCHEMA

MAX_LENGTH_BINS = 40
MAX_TIME_BINS = 120
# Bin widths of the throughput plot: the smallest giving at most MAX_TIME_BINS bins.
TIME_BIN_SECONDS = (10, 30, 60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 86400)


@dataclass(frozen=True)
class LengthHistogram:
    edges: list[int]  # len(counts) + 1 bin edges; bin i is [edges[i], edges[i+1])
    counts: list[int]
    turns: int
    median: float | None
    p95: float | None
    max_tokens: int | None  # the per-turn cap, when known


def length_histogram(
    turn_tokens: Sequence[int], max_tokens: int | None, max_bins: int = MAX_LENGTH_BINS
) -> LengthHistogram:
    """Integer-aligned bins reaching ``max_tokens``, so turns cut at the cap share a bin."""
    values = np.asarray(turn_tokens, dtype=np.int64)
    upper = max(int(values.max()) if values.size else 0, max_tokens or 0)
    width = max(1, math.ceil((upper + 1) / max_bins))
    edges = list(range(0, (upper // width + 1) * width + 1, width))
    # The right-most bin is closed in np.histogram; the top edge lies above every value,
    # so each bin is [edge, next edge) for all of them.
    counts, _ = np.histogram(values, bins=np.asarray(edges, dtype=np.float64))
    median = float(np.median(values)) if values.size else None
    p95 = float(np.percentile(values, 95)) if values.size else None
    return LengthHistogram(
        edges, [int(c) for c in counts], int(values.size), median, p95, max_tokens
    )


@dataclass(frozen=True)
class BudgetUse:
    completion_tokens: int  # in the output: what the budget counts
    waste_tokens: int  # generated, not in the output
    token_budget: int | None
    # Of the waste: what requests cancelled in flight decoded, and the part of it estimated.
    abandoned_tokens: int = 0
    abandoned_tokens_estimated: int = 0

    @property
    def used_share(self) -> float | None:
        return self.completion_tokens / self.token_budget if self.token_budget else None

    @property
    def waste_share(self) -> float | None:
        return self.waste_tokens / self.token_budget if self.token_budget else None


def budget_use(stats: Mapping[str, Any]) -> BudgetUse:
    return BudgetUse(
        int(stats["completion_tokens"]),
        int(stats["waste_tokens"]),
        stats.get("token_budget"),
        int(stats.get("abandoned_tokens", 0)),  # 0 in stats written before it was counted
        int(stats.get("abandoned_tokens_estimated", 0)),
    )


def waste_text(use: BudgetUse) -> str:
    """``150 waste``, and the part requests cancelled in flight decoded: ``150 waste (40
    cancelled)``; ``~``: partly estimated."""
    text = f"{fmt(use.waste_tokens)} waste"
    if not use.abandoned_tokens:
        return text
    about = "~" if use.abandoned_tokens_estimated else ""
    return f"{text} ({about}{fmt(use.abandoned_tokens)} cancelled)"


@dataclass(frozen=True)
class BudgetBar:
    """One dataset's bar of ``budget_use.png``."""

    dataset: str
    use: BudgetUse
    stop_reason: str | None  # None: the prefix is not decided yet (a running workflow)


@dataclass(frozen=True)
class JournalSeries:
    """One dataset's line of ``throughput.png``: its journal summarised."""

    dataset: str
    journal: pl.DataFrame  # generation.records.SUMMARY_SCHEMA rows
    note: str | None  # why it gives no timestamps, if it does not


@dataclass(frozen=True)
class Truncation:
    conversations: int
    last_turn_cut: int  # finish_reason == "length" (the row's, i.e. its last turn's)
    any_turn_cut: int  # some turn hit max_tokens (what stats.json calls "truncated")

    @property
    def last_turn_share(self) -> float:
        return self.last_turn_cut / self.conversations if self.conversations else 0.0

    @property
    def any_turn_share(self) -> float:
        return self.any_turn_cut / self.conversations if self.conversations else 0.0


_ROW_SCHEMA = {
    "finish_reason": pl.String,
    "turns": pl.List(pl.Struct({"completion_tokens": pl.Int64, "finish_reason": pl.String})),
    "sampling": pl.Struct({"max_tokens": pl.Int64}),
}


def read_response_rows(path: str | Path) -> pl.DataFrame:
    """Only the columns the report needs, from a responses file of any size."""
    if Path(path).stat().st_size == 0:
        return pl.DataFrame(schema=_ROW_SCHEMA)
    return pl.scan_ndjson(path, schema=_ROW_SCHEMA).collect()


def turn_lengths(rows: pl.DataFrame) -> list[int]:
    """Completion tokens of every assistant turn, in row order."""
    turns = rows.select(pl.col("turns").explode()).drop_nulls()
    return turns["turns"].struct.field("completion_tokens").to_list()


def max_tokens_of(rows: pl.DataFrame) -> int | None:
    caps = rows["sampling"].struct.field("max_tokens").drop_nulls()
    return int(caps.max()) if caps.len() else None  # type: ignore[arg-type]


def truncation(rows: pl.DataFrame) -> Truncation:
    cut_turns = pl.col("turns").list.eval(pl.element().struct.field("finish_reason") == "length")
    counts = rows.select(
        last=(pl.col("finish_reason") == "length").sum(),
        any=cut_turns.list.any().sum(),
    )
    return Truncation(rows.height, int(counts["last"][0]), int(counts["any"][0]))


@dataclass(frozen=True)
class Throughput:
    stamped: int  # journal records with finished_at
    unstamped: int  # records written before finished_at was recorded
    first_bin: int  # index of the first bin, counted from the common origin
    tokens_per_minute: list[float]  # one per bin from first_bin on (0 in gaps)


@dataclass(frozen=True)
class ThroughputAxis:
    origin: float | None  # unix time of the earliest stamped record of any dataset
    bin_s: int


def throughput_axis(journals: Mapping[str, pl.DataFrame]) -> ThroughputAxis:
    """One time axis for all datasets, so a run's datasets line up one after the other."""
    times = [j["finished_at"].drop_nulls() for j in journals.values()]
    stamped = [t for t in times if t.len()]
    if not stamped:
        return ThroughputAxis(None, TIME_BIN_SECONDS[0])
    start = min(float(t.min()) for t in stamped)  # type: ignore[arg-type]
    span = max(float(t.max()) for t in stamped) - start  # type: ignore[arg-type]
    bin_s = next((b for b in TIME_BIN_SECONDS if span / b <= MAX_TIME_BINS), TIME_BIN_SECONDS[-1])
    return ThroughputAxis(start, bin_s)


def throughput(journal: pl.DataFrame, axis: ThroughputAxis) -> Throughput:
    """Completion tokens journaled per bin (used or wasted: what the engine produced),
    as a rate per minute."""
    stamped = journal.filter(pl.col("finished_at").is_not_null())
    unstamped = journal.height - stamped.height
    if stamped.height == 0 or axis.origin is None:
        return Throughput(0, unstamped, 0, [])
    bins = ((stamped["finished_at"] - axis.origin) // axis.bin_s).cast(pl.Int64)
    per_bin = (
        stamped.with_columns(bin=bins).group_by("bin").agg(pl.col("spent_tokens").sum()).sort("bin")
    )
    first, last = int(per_bin["bin"][0]), int(per_bin["bin"][-1])
    dense = np.zeros(last - first + 1, dtype=np.float64)
    dense[per_bin["bin"].to_numpy() - first] = per_bin["spent_tokens"].to_numpy()
    rate = dense * (60.0 / axis.bin_s)
    return Throughput(stamped.height, unstamped, first, [float(r) for r in rate])


@dataclass(frozen=True)
class ShardTokens:
    tokens: list[int]  # per shard, in shard order
    samples: list[int]
    cap_tokens: int | None  # shard_bytes // bytes per token: no shard of 2+ samples exceeds it


def shard_tokens(
    manifest: Mapping[str, Any], plan: Mapping[str, Any], shard_bytes: int | None
) -> ShardTokens:
    shards = manifest["shards"]
    per_token = plan.get("bytes_per_token")
    cap = max(1, shard_bytes // per_token) if shard_bytes and per_token else None
    return ShardTokens([int(s["tokens"]) for s in shards], [int(s["samples"]) for s in shards], cap)


@dataclass(frozen=True)
class DatasetReport:
    dataset: str
    stats: dict[str, Any]  # results/responses/{dataset}.stats.json
    tokenize_stats: dict[str, Any]
    manifest: dict[str, Any]
    lengths: LengthHistogram
    budget: BudgetUse
    truncation: Truncation
    shards: ShardTokens
    journal: pl.DataFrame  # generation.records.SUMMARY_SCHEMA rows
    journal_note: str | None  # why the journal gives no timestamps, if it does not

    @property
    def budget_bar(self) -> BudgetBar:
        return BudgetBar(self.dataset, self.budget, self.stats.get("stop_reason"))

    @property
    def journal_series(self) -> JournalSeries:
        return JournalSeries(self.dataset, self.journal, self.journal_note)


def read_json(path: str | Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)  # type: ignore[no-any-return]


def load_journal(records: str | Path) -> tuple[pl.DataFrame, str | None]:
    """The generated conversations the responses were selected from (the journal as the
    generate job summarised it), and why they give no timestamps, if they do not."""
    summary = pl.read_parquet(records)
    # Written before abandoned records existed: none of its rows is one.
    missing = {"abandoned": False, "spent_estimated": 0}
    summary = summary.with_columns(
        pl.lit(v).alias(k) for k, v in missing.items() if k not in summary.columns
    ).select(list(SUMMARY_SCHEMA))
    return summary.cast(SUMMARY_SCHEMA), journal_note(summary)  # type: ignore[arg-type]


def journal_note(summary: pl.DataFrame) -> str | None:
    """Why a journal summary gives no (or not every) timestamp, if it does not."""
    stamped = summary["finished_at"].drop_nulls().len()
    if summary.height and not stamped:
        return "journal predates timestamps (no finished_at)"
    if stamped < summary.height:
        return f"{summary.height - stamped} older records without finished_at"
    return None


def load_dataset(
    dataset: str,
    *,
    responses: str | Path,
    response_stats: str | Path,
    tokenize_stats: str | Path,
    records: str | Path,
    plan: str | Path,
    manifest: str | Path,
    shard_bytes: int | None,
) -> DatasetReport:
    rows = read_response_rows(responses)
    stats = read_json(response_stats)
    manifest_data = read_json(manifest)
    journal, note = load_journal(records)
    return DatasetReport(
        dataset=dataset,
        stats=stats,
        tokenize_stats=read_json(tokenize_stats),
        manifest=manifest_data,
        lengths=length_histogram(turn_lengths(rows), max_tokens_of(rows)),
        budget=budget_use(stats),
        truncation=truncation(rows),
        shards=shard_tokens(manifest_data, read_json(plan), shard_bytes),
        journal=journal,
        journal_note=note,
    )


def fmt(n: float) -> str:
    return f"{n:,.0f}"
