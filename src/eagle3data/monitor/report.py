"""Pictures of a run: what people would rather look at than read in the stats files.

One figure per question, every dataset in it (datasets keep one colour throughout):

* ``completion_lengths.png``: histogram of completion tokens per assistant turn, with
  ``max_tokens`` marked (the bar at the line is the turns that were cut off);
* ``budget_use.png``: completion tokens in the output and the waste, as shares of the
  token budget, with the part of the waste requests cancelled in flight decoded (also
  drawn for a running workflow: ``eagle3data-status --plot DIR``);
* ``truncation.png``: share of conversations whose last turn ended with
  ``finish_reason == "length"`` (and whose any turn did);
* ``throughput.png``: completion tokens generated per minute over time, from the
  ``finished_at`` of each generated conversation (``{dataset}.records.parquet``, the
  journal summarised by the generate job; journals written before it was recorded are
  named; also drawn for a running workflow, from the journals themselves);
* ``shard_tokens.png``: tokens per hidden-state shard, with the cap ``shard_bytes`` sets;
* ``summary.html``: one table per dataset and the pictures, in one self-contained file.

The data preparation is plain functions over small inputs (unit tested); the plotting
uses matplotlib's Agg canvas with a fixed size and dpi and no PNG metadata, so the same
inputs give the same bytes.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from ..atomic import atomic_open, atomic_path
from ..generation.records import SUMMARY_SCHEMA
from ..units import duration, human_bytes

log = logging.getLogger(__name__)

FIGURES = ("completion_lengths", "budget_use", "truncation", "throughput", "shard_tokens")
DPI = 100
WIDTH_IN = 10.0
PANEL_COLUMNS = 3  # small multiples: panels per row
MAX_LENGTH_BINS = 40
MAX_TIME_BINS = 120
# Bin widths of the throughput plot: the smallest giving at most MAX_TIME_BINS bins.
TIME_BIN_SECONDS = (10, 30, 60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 86400)
CAP_LINE_RANGE = 5  # draw the shard cap when it is at most this many times the top bar
MAX_SHARD_BARS = 100  # more shards are drawn as one filled step line (fast, readable)


# --- data preparation ------------------------------------------------------------


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
    text = f"{_fmt(use.waste_tokens)} waste"
    if not use.abandoned_tokens:
        return text
    about = "~" if use.abandoned_tokens_estimated else ""
    return f"{text} ({about}{_fmt(use.abandoned_tokens)} cancelled)"


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


# --- figures ---------------------------------------------------------------------


def grid_shape(n: int) -> tuple[int, int]:
    cols = min(PANEL_COLUMNS, max(n, 1))
    return math.ceil(max(n, 1) / cols), cols


def figure_size(figure: str, n_datasets: int) -> tuple[float, float]:
    """Inches (width, height) of a figure; pixels are these times DPI."""
    if figure in ("completion_lengths", "shard_tokens"):
        rows, _ = grid_shape(n_datasets)
        return WIDTH_IN, 0.9 + 2.6 * rows
    if figure == "budget_use":
        return WIDTH_IN, 1.6 + 0.55 * max(n_datasets, 1)
    return WIDTH_IN, 4.5


def dataset_colors(datasets: Sequence[str]) -> dict[str, Any]:
    from matplotlib import colormaps

    palette = colormaps["tab10"]
    return {ds: palette(i % 10) for i, ds in enumerate(datasets)}


def _new_figure(figure: str, n_datasets: int) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figure_size(figure, n_datasets), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)  # explicit Agg: no display, no global pyplot state
    return fig


def save_png(fig: Any, path: str | Path) -> None:
    # No "Software" text chunk (the only metadata Agg writes): same inputs, same bytes.
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=DPI, metadata={"Software": None})


def _panels(fig: Any, n: int) -> list[Any]:
    rows, cols = grid_shape(n)
    axes = fig.subplots(rows, cols, squeeze=False).ravel().tolist()
    for ax in axes[n:]:
        ax.set_visible(False)
    return axes[:n]


def _fmt(n: float) -> str:
    return f"{n:,.0f}"


def _empty_note(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.35")


def plot_completion_lengths(reports: Sequence[DatasetReport], path: str | Path) -> None:
    fig = _new_figure("completion_lengths", len(reports))
    colors = dataset_colors([r.dataset for r in reports])
    for ax, r in zip(_panels(fig, len(reports)), reports, strict=True):
        h = r.lengths
        ax.set_title(f"{r.dataset}: {h.turns:,} assistant turns", fontsize=10)
        ax.set_xlabel("completion tokens per turn")
        ax.set_ylabel("turns")
        if h.turns == 0:
            _empty_note(ax, "no responses")
            continue
        ax.stairs(h.counts, h.edges, fill=True, color=colors[r.dataset], alpha=0.85)
        numbers = f"median {h.median:,.0f}\np95 {h.p95:,.0f}"
        if h.max_tokens is not None:
            ax.axvline(h.max_tokens, color="black", linestyle="--", linewidth=1)
            numbers += f"\ndashed: max_tokens {h.max_tokens:,}"
        ax.text(0.02, 0.97, numbers, va="top", transform=ax.transAxes, fontsize=8)
        ax.set_ylim(0, 1.25 * max(h.counts))  # room for the numbers above the bars
    fig.suptitle("Completion length per assistant turn")
    save_png(fig, path)


def budget_use_figure(bars: Sequence[BudgetBar], title: str = "Budget use per dataset") -> Any:
    fig = _new_figure("budget_use", len(bars))
    ax = fig.subplots()
    colors = dataset_colors([b.dataset for b in bars])
    names = [b.dataset for b in bars]
    y = np.arange(len(bars))
    for i, bar in enumerate(bars):
        b = bar.use
        stop = "not decided yet" if bar.stop_reason is None else f"stopped by {bar.stop_reason}"
        if b.used_share is None or b.waste_share is None:
            reason = "no token_budget" if b.token_budget is None else "token_budget 0"
            ax.text(
                1,
                i,
                f"{reason}: {_fmt(b.completion_tokens)} tokens, {waste_text(b)}; {stop}",
                va="center",
                fontsize=8,
            )
            continue
        used, waste = 100 * b.used_share, 100 * b.waste_share
        ax.barh(i, used, color=colors[bar.dataset], height=0.6)
        ax.barh(i, waste, left=used, color="0.75", hatch="//", edgecolor="0.45", height=0.6)
        ax.text(
            used + waste + 1,
            i,
            f"{_fmt(b.completion_tokens)} / {_fmt(b.token_budget or 0)} ({used:.0f}%)"
            f" + {waste_text(b)}; {stop}",
            va="center",
            fontsize=8,
        )
    ax.axvline(100, color="black", linestyle="--", linewidth=1)
    ax.set_yticks(y, names)
    ax.set_ylim(len(bars) - 0.5, -0.5)  # first dataset on top, as in the config
    ends = [
        100 * (b.use.completion_tokens + b.use.waste_tokens) / b.use.token_budget
        for b in bars
        if b.use.token_budget
    ]
    ax.set_xlim(0, max([100.0, *ends]) + 60)  # room for the numbers right of the bars
    _fit_texts(ax)
    ax.set_xlabel("% of token_budget (dashed line: the budget)")
    from matplotlib.patches import Patch

    # Below the axes, never over them: inside, it covered the last bar's numbers.
    fig.legend(
        handles=[
            Patch(color="0.35", label="in the output (completion tokens)"),
            Patch(
                facecolor="0.75", hatch="//", edgecolor="0.45", label="waste (generated, unused)"
            ),
        ],
        loc="outside lower center",
        ncols=2,
        fontsize=8,
    )
    ax.set_title(title)
    return fig


def _fit_texts(ax: Any, margin_px: float = 6.0) -> None:
    """Widen the x axis until every text that starts inside it ends inside it (long
    numbers right of a long bar ran off the figure)."""
    for text in ax.texts:
        text.set_in_layout(False)  # else the layout shrinks the axes around it instead
    renderer = ax.figure.canvas.get_renderer()
    ax.figure.canvas.draw()  # the layout, so the axes' width is the final one
    width = ax.get_window_extent(renderer).width
    right = ax.get_xlim()[1]
    for text in ax.texts:
        needed = text.get_window_extent(renderer).width + margin_px
        if needed < width:  # (wider than the axes: no limit fits it)
            right = max(right, text.get_position()[0] * width / (width - needed))
    ax.set_xlim(0, right)


def plot_budget_use(bars: Sequence[BudgetBar], path: str | Path, **kwargs: Any) -> None:
    save_png(budget_use_figure(bars, **kwargs), path)


def plot_truncation(reports: Sequence[DatasetReport], path: str | Path) -> None:
    fig = _new_figure("truncation", len(reports))
    ax = fig.subplots()
    colors = dataset_colors([r.dataset for r in reports])
    x = np.arange(len(reports))
    width = 0.38
    for i, r in enumerate(reports):
        t = r.truncation
        ax.bar(i - width / 2, 100 * t.last_turn_share, width, color=colors[r.dataset])
        ax.bar(
            i + width / 2,
            100 * t.any_turn_share,
            width,
            facecolor="none",
            edgecolor=colors[r.dataset],
            hatch="//",
        )
        ax.text(
            i - width / 2,
            100 * t.last_turn_share + 1,
            f"{t.last_turn_cut}/{t.conversations}",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(x, [r.dataset for r in reports])
    ax.set_ylim(0, 110)
    ax.set_ylabel("% of conversations in the output")
    from matplotlib.patches import Patch

    ax.legend(
        handles=[
            Patch(color="0.35", label='last turn finish_reason == "length"'),
            Patch(facecolor="none", edgecolor="0.35", hatch="//", label="any turn cut off"),
        ],
        loc="upper right",
        fontsize=8,
    )
    ax.set_title("Truncation: responses cut off at max_tokens")
    save_png(fig, path)


def plot_throughput(journals: Sequence[JournalSeries], path: str | Path) -> None:
    fig = _new_figure("throughput", len(journals))
    ax = fig.subplots()
    colors = dataset_colors([j.dataset for j in journals])
    axis = throughput_axis({j.dataset: j.journal for j in journals})
    series = {j.dataset: throughput(j.journal, axis) for j in journals}
    end_bin = max((s.first_bin + len(s.tokens_per_minute) for s in series.values()), default=0)
    in_hours = end_bin * axis.bin_s > 2 * 3600
    unit_s = 3600 if in_hours else 60
    unplotted = []
    for r in journals:
        s = series[r.dataset]
        if not s.tokens_per_minute:
            unplotted.append(f"{r.dataset}: {r.note or 'no records'}")
            continue
        label = r.dataset if r.note is None else f"{r.dataset} ({r.note})"
        edges = (s.first_bin + np.arange(len(s.tokens_per_minute) + 1)) * axis.bin_s / unit_s
        ax.stairs(s.tokens_per_minute, edges, color=colors[r.dataset], linewidth=1.5, label=label)
    # Journals written before finished_at was recorded have no time axis: say so
    # instead of silently drawing nothing.
    if axis.origin is None:
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_title("Generation throughput: no timestamps")
        _empty_note(ax, "Not plotted (no timestamps):\n" + "\n".join(unplotted))
    else:
        start = dt.datetime.fromtimestamp(axis.origin, tz=dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        ax.set_xlabel(f"{'hours' if in_hours else 'minutes'} since {start}")
        ax.set_ylabel("completion tokens per minute")
        ax.set_ylim(bottom=0)
        for note in unplotted:
            ax.plot([], [], " ", label=f"not plotted: {note}")
        fig.legend(loc="outside right upper", fontsize=8)
        ax.set_title(f"Generation throughput (completion tokens per minute, {axis.bin_s:,} s bins)")
    save_png(fig, path)


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def plot_shard_tokens(reports: Sequence[DatasetReport], path: str | Path) -> None:
    from matplotlib.ticker import MaxNLocator

    fig = _new_figure("shard_tokens", len(reports))
    colors = dataset_colors([r.dataset for r in reports])
    for ax, r in zip(_panels(fig, len(reports)), reports, strict=True):
        s = r.shards
        title = f"{r.dataset}: {_plural(len(s.tokens), 'shard')}, {_plural(sum(s.tokens), 'token')}"
        if s.cap_tokens is not None:
            title += f"\ncap {s.cap_tokens:,} tokens per shard"
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("shard")
        ax.set_ylabel("tokens")
        if not s.tokens:
            _empty_note(ax, "no shards (no conversations)")
            continue
        shards = np.arange(len(s.tokens))
        if len(s.tokens) <= MAX_SHARD_BARS:
            ax.bar(shards, s.tokens, color=colors[r.dataset], width=0.8)
        else:
            ax.stairs(
                s.tokens, np.append(shards, len(s.tokens)) - 0.5, fill=True, color=colors[r.dataset]
            )
        ax.set_xlim(-0.6, len(s.tokens) - 0.4)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        # The cap line only where it does not flatten the bars into the axis.
        if s.cap_tokens is not None and s.cap_tokens <= CAP_LINE_RANGE * max(s.tokens):
            ax.axhline(s.cap_tokens, color="black", linestyle="--", linewidth=1)
            ax.set_ylim(0, 1.08 * max(s.cap_tokens, max(s.tokens)))
    fig.suptitle("Tokens per hidden-state shard")
    save_png(fig, path)


PLOTTERS: dict[str, Callable[[Sequence[DatasetReport], str | Path], None]] = {
    "completion_lengths": plot_completion_lengths,
    "budget_use": lambda reports, path: plot_budget_use([r.budget_bar for r in reports], path),
    "truncation": plot_truncation,
    "throughput": lambda reports, path: plot_throughput([r.journal_series for r in reports], path),
    "shard_tokens": plot_shard_tokens,
}

# What ``eagle3data-status --plot DIR`` draws of a workflow that may still be running.
LIVE_FIGURES = ("budget_use", "throughput")


def plot_live(
    bars: Sequence[BudgetBar], series: Sequence[JournalSeries], out_dir: str | Path
) -> list[Path]:
    """The budget and throughput pictures from the journals as they are now (the report
    rule draws them only once every dataset is validated)."""
    out = Path(out_dir)
    paths = [out / f"{name}.png" for name in LIVE_FIGURES]
    plot_budget_use(bars, paths[0], title="Budget use per dataset so far")
    plot_throughput(series, paths[1])
    return paths


# --- summary page ----------------------------------------------------------------


def _share(part: int, whole: int | None) -> str:
    return f" ({100 * part / whole:.1f}%)" if whole else ""


def _count(part: int, whole: int | None) -> str:
    return _fmt(part) + _share(part, whole)


def cancelled_text(stats: Mapping[str, Any]) -> str:
    """What conversations cancelled in flight cost, e.g. ``1,204 tokens in 12 requests
    (300 estimated)``: part of the waste (stats written before it was counted: n/a)."""
    if "abandoned_tokens" not in stats:
        return "n/a (not counted when these stats were written)"
    text = (
        f"{_fmt(stats['abandoned_tokens'])} tokens in {_fmt(stats['abandoned_requests'])} requests"
    )
    estimated = stats.get("abandoned_tokens_estimated", 0)
    return text + (f" ({_fmt(estimated)} estimated)" if estimated else "")


def summary_rows(r: DatasetReport) -> list[tuple[str, str]]:
    """The numbers of one dataset's table, as (what, value) pairs."""
    st, tok, man = r.stats, r.tokenize_stats, r.manifest
    budget = st.get("token_budget")
    times = r.journal["finished_at"].drop_nulls()
    span_s = float(times.max() - times.min()) if times.len() else 0.0  # type: ignore[operator]
    tokens = int(r.journal.filter(pl.col("finished_at").is_not_null())["spent_tokens"].sum())
    if span_s > 0:
        rate = _fmt(60 * tokens / span_s)
        speed = f"{_fmt(tokens)} tokens in {duration(span_s)} ({rate} per minute)"
    else:
        speed = r.journal_note or "too few timestamped records for a rate"
    return [
        ("prompts", _fmt(st["prompts"])),
        ("in the output", _fmt(st["in_output"])),
        (
            "failed / beyond limits / bad input",
            f"{st['failed']} / {st['beyond_limits']} / {st.get('skipped_input', 0)}",
        ),
        ("token budget", "none" if budget is None else _fmt(budget)),
        (
            "completion tokens",
            _fmt(st["completion_tokens"]) + _share(st["completion_tokens"], budget),
        ),
        ("waste tokens", _fmt(st["waste_tokens"]) + _share(st["waste_tokens"], budget)),
        ("of which cancelled in flight", cancelled_text(st)),
        ("stopped by", str(st.get("stop_reason"))),
        (
            "last turn cut (finish_reason length)",
            _count(r.truncation.last_turn_cut, r.truncation.conversations),
        ),
        (
            "any turn cut",
            _count(r.truncation.any_turn_cut, r.truncation.conversations),
        ),
        (
            "median / p95 completion tokens per turn",
            "n/a"
            if r.lengths.median is None
            else f"{r.lengths.median:,.0f} / {r.lengths.p95:,.0f}",
        ),
        ("generation", speed),
        ("tokenized tokens / loss tokens", f"{_fmt(tok['tokens'])} / {_fmt(tok['loss_tokens'])}"),
        (
            "dropped / truncated at max_seq_len",
            f"{len(tok.get('dropped', []))} / {tok.get('truncated', 0)}",
        ),
        (
            "shards / tokens / bytes",
            f"{man['num_shards']} / {_fmt(man['num_tokens'])} / {human_bytes(man['bytes'])}",
        ),
        ("target agrees with its tokens (control)", agreement_text(man.get("agreement"))),
    ]


def agreement_text(check: Mapping[str, Any] | None) -> str:
    """The validate job's agreement check as one cell: ``0.9725 (control 0.0116), greedy,
    1202 positions``; sampled data adds the mean log-probabilities."""
    if check is None:
        return "not checked (validate.agreement.enabled: false)"
    if not check.get("positions"):
        return "no positions to check"
    text = (
        f"{check['agreement']:.4f} (control {check['control_agreement']:.4f}), "
        f"{'greedy' if check['greedy'] else 'sampled'}, {check['positions']:,} positions"
    )
    if not check["greedy"]:
        text += (
            f"; log-prob {check['mean_logprob']:.2f} (control {check['control_mean_logprob']:.2f})"
        )
    return text


_STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0 2em 1.5em 0; display: inline-table;
        vertical-align: top; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: left; font-size: 0.9em; }
td.v { text-align: right; font-variant-numeric: tabular-nums; }
img { max-width: 100%; display: block; margin-bottom: 1.5em; }
"""


def summary_html(reports: Sequence[DatasetReport], images: Mapping[str, Path]) -> str:
    """One page, no external files: the tables, then the figures as data URIs."""
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8"><title>eagle3-data run summary</title>',
        f"<style>{_STYLE}</style></head><body>",
        "<h1>eagle3-data run summary</h1>",
        f"<p>{len(reports)} datasets: {html.escape(', '.join(r.dataset for r in reports))}</p>",
    ]
    for r in reports:
        name = html.escape(r.dataset)
        out.append(f'<table id="{name}"><caption><b>{name}</b></caption>')
        out.extend(
            f'<tr><th>{html.escape(k)}</th><td class="v">{html.escape(v)}</td></tr>'
            for k, v in summary_rows(r)
        )
        out.append("</table>")
    for name, image in images.items():
        data = base64.b64encode(Path(image).read_bytes()).decode("ascii")
        out.append(f"<h2>{html.escape(name.replace('_', ' '))}</h2>")
        out.append(f'<img alt="{html.escape(name)}" src="data:image/png;base64,{data}">')
    out.append("</body></html>")
    return "\n".join(out) + "\n"


# --- the step --------------------------------------------------------------------


def build_report(
    *,
    datasets: Sequence[str],
    responses: Sequence[str],
    response_stats: Sequence[str],
    records: Sequence[str],
    tokenize_stats: Sequence[str],
    plans: Sequence[str],
    manifests: Sequence[str],
    shard_bytes: int | None,
    out_images: Mapping[str, str],
    out_summary: str,
) -> None:
    """Write every figure of ``FIGURES`` to ``out_images[name]`` and the summary page."""
    reports = [
        load_dataset(
            ds,
            responses=resp,
            response_stats=stats,
            records=recs,
            tokenize_stats=tok,
            plan=plan,
            manifest=man,
            shard_bytes=shard_bytes,
        )
        for ds, resp, stats, recs, tok, plan, man in zip(
            datasets,
            responses,
            response_stats,
            records,
            tokenize_stats,
            plans,
            manifests,
            strict=True,
        )
    ]
    for r in reports:
        if r.journal_note:
            log.info("%s: %s", r.dataset, r.journal_note)
    for name in FIGURES:
        PLOTTERS[name](reports, out_images[name])
        log.info("wrote %s", out_images[name])
    with atomic_open(out_summary) as fh:
        fh.write(summary_html(reports, {name: Path(out_images[name]) for name in FIGURES}))
    log.info("wrote %s", out_summary)
