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
import html
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from ..atomic import atomic_open
from ..units import duration, human_bytes
from .report_data import DatasetReport, fmt, load_dataset
from .report_figures import PLOTTERS

log = logging.getLogger(__name__)
FIGURES = ("completion_lengths", "budget_use", "truncation", "throughput", "shard_tokens")


def _share(part: int, whole: int | None) -> str:
    return f" ({100 * part / whole:.1f}%)" if whole else ""


def _count(part: int, whole: int | None) -> str:
    return fmt(part) + _share(part, whole)


def cancelled_text(stats: Mapping[str, Any]) -> str:
    """What conversations cancelled in flight cost, e.g. ``1,204 tokens in 12 requests
    (300 estimated)``: part of the waste (stats written before it was counted: n/a)."""
    if "abandoned_tokens" not in stats:
        return "n/a (not counted when these stats were written)"
    text = f"{fmt(stats['abandoned_tokens'])} tokens in {fmt(stats['abandoned_requests'])} requests"
    estimated = stats.get("abandoned_tokens_estimated", 0)
    return text + (f" ({fmt(estimated)} estimated)" if estimated else "")


def summary_rows(r: DatasetReport) -> list[tuple[str, str]]:
    """The numbers of one dataset's table, as (what, value) pairs."""
    st, tok, man = r.stats, r.tokenize_stats, r.manifest
    budget = st.get("token_budget")
    times = r.journal["finished_at"].drop_nulls()
    span_s = float(times.max() - times.min()) if times.len() else 0.0  # type: ignore[operator]
    tokens = int(r.journal.filter(pl.col("finished_at").is_not_null())["spent_tokens"].sum())
    if span_s > 0:
        rate = fmt(60 * tokens / span_s)
        speed = f"{fmt(tokens)} tokens in {duration(span_s)} ({rate} per minute)"
    else:
        speed = r.journal_note or "too few timestamped records for a rate"
    return [
        ("prompts", fmt(st["prompts"])),
        ("in the output", fmt(st["in_output"])),
        (
            "failed / beyond limits / bad input",
            f"{st['failed']} / {st['beyond_limits']} / {st.get('skipped_input', 0)}",
        ),
        ("token budget", "none" if budget is None else fmt(budget)),
        (
            "completion tokens",
            fmt(st["completion_tokens"]) + _share(st["completion_tokens"], budget),
        ),
        ("waste tokens", fmt(st["waste_tokens"]) + _share(st["waste_tokens"], budget)),
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
        ("tokenized tokens / loss tokens", f"{fmt(tok['tokens'])} / {fmt(tok['loss_tokens'])}"),
        (
            "dropped / truncated at max_seq_len",
            f"{len(tok.get('dropped', []))} / {tok.get('truncated', 0)}",
        ),
        (
            "shards / tokens / bytes",
            f"{man['num_shards']} / {fmt(man['num_tokens'])} / {human_bytes(man['bytes'])}",
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
