"""The report's figures (matplotlib, headless): one PNG per figure, small multiples with a
panel per dataset, and the live figures ``eagle3data-status`` draws."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import atomic_path
from .report_data import (
    BudgetBar,
    DatasetReport,
    JournalSeries,
    fmt,
    throughput,
    throughput_axis,
    waste_text,
)

DPI = 100
WIDTH_IN = 10.0
PANEL_COLUMNS = 3  # small multiples: panels per row
CAP_LINE_RANGE = 5  # draw the shard cap when it is at most this many times the top bar
MAX_SHARD_BARS = 100  # more shards are drawn as one filled step line (fast, readable)


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
                f"{reason}: {fmt(b.completion_tokens)} tokens, {waste_text(b)}; {stop}",
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
            f"{fmt(b.completion_tokens)} / {fmt(b.token_budget or 0)} ({used:.0f}%)"
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
