"""The run report: its numbers on hand-made inputs, its files, and `snakemake --report`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from PIL import Image

from eagle3data.generation.records import SUMMARY_SCHEMA, summarise
from eagle3data.monitor.report import FIGURES, build_report, cancelled_text, summary_rows
from eagle3data.monitor.report_data import (
    BudgetBar,
    BudgetUse,
    budget_use,
    length_histogram,
    load_dataset,
    load_journal,
    max_tokens_of,
    read_response_rows,
    shard_tokens,
    throughput,
    throughput_axis,
    truncation,
    turn_lengths,
    waste_text,
)
from eagle3data.monitor.report_figures import DPI, budget_use_figure, figure_size


def _turn(tokens: int, finish: str = "stop") -> dict[str, Any]:
    return {"prompt_tokens": 10, "completion_tokens": tokens, "finish_reason": finish}


def _row(turns: list[dict[str, Any]], max_tokens: int = 8) -> dict[str, Any]:
    return {
        "id": f"r{len(turns)}",
        "finish_reason": turns[-1]["finish_reason"],
        "turns": turns,
        "usage": {"completion_tokens": sum(t["completion_tokens"] for t in turns)},
        "sampling": {"max_tokens": max_tokens, "temperature": 0.0},
        "messages": [],
    }


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [
    _row([_turn(8, "length")]),  # cut off
    _row([_turn(8, "length"), _turn(3)]),  # first turn cut, last turn fine
    _row([_turn(5)]),
]


def test_lengths_and_truncation_from_response_rows(tmp_path: Path) -> None:
    rows = read_response_rows(_write_jsonl(tmp_path / "A1.jsonl", ROWS))
    assert turn_lengths(rows) == [8, 8, 3, 5]
    assert max_tokens_of(rows) == 8
    cut = truncation(rows)
    assert (cut.conversations, cut.last_turn_cut, cut.any_turn_cut) == (3, 1, 2)
    assert cut.last_turn_share == pytest.approx(1 / 3)
    assert cut.any_turn_share == pytest.approx(2 / 3)


def test_an_empty_responses_file_gives_empty_numbers(tmp_path: Path) -> None:
    empty = tmp_path / "A1.jsonl"
    empty.write_text("")
    rows = read_response_rows(empty)
    assert turn_lengths(rows) == []
    assert max_tokens_of(rows) is None
    assert truncation(rows).last_turn_share == 0.0
    hist = length_histogram([], None)
    assert (hist.turns, sum(hist.counts), hist.median) == (0, 0, None)


def test_length_bins_are_integer_aligned_and_reach_max_tokens() -> None:
    hist = length_histogram([1, 2, 2, 3, 80], max_tokens=80, max_bins=40)
    # ceil(81 / 40) = 3 tokens per bin; 80 lands in the last bin [78, 81).
    assert hist.edges[:3] == [0, 3, 6] and hist.edges[-1] == 81
    assert len(hist.counts) == 27 and sum(hist.counts) == 5
    assert hist.counts[0] == 3 and hist.counts[1] == 1 and hist.counts[-1] == 1
    assert hist.median == 2.0
    assert hist.p95 == pytest.approx(64.6)  # linear between 3 and 80
    # The bins reach max_tokens even when no turn got there.
    assert length_histogram([1, 2], max_tokens=100).edges[-1] > 100


def test_budget_use_as_shares_of_the_budget() -> None:
    use = budget_use({"completion_tokens": 900, "waste_tokens": 150, "token_budget": 1000})
    assert (use.used_share, use.waste_share) == (0.9, 0.15)
    no_budget = budget_use({"completion_tokens": 5, "waste_tokens": 0, "token_budget": None})
    assert no_budget.used_share is None and no_budget.waste_share is None
    zero = budget_use({"completion_tokens": 0, "waste_tokens": 0, "token_budget": 0})
    assert zero.used_share is None


def _journal(rows: list[tuple[float | None, int]]) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "id": [f"p{i}" for i in range(len(rows))],
            "prompt_hash": ["h"] * len(rows),
            "failed": [False] * len(rows),
            "completion_tokens": [t for _, t in rows],
            "spent_tokens": [t for _, t in rows],
            "conversation_tokens": [t + 10 for _, t in rows],
            "finished_at": [at for at, _ in rows],
            "abandoned": [False] * len(rows),
            "spent_estimated": [0] * len(rows),
        },
        schema=SUMMARY_SCHEMA,
    )


def test_throughput_bins_tokens_per_minute_on_a_shared_time_axis() -> None:
    a1 = _journal([(1000.0, 60), (1005.0, 30), (1070.0, 120)])
    b2 = _journal([(None, 50), (1100.0, 10)])
    axis = throughput_axis({"A1": a1, "B2": b2})
    assert (axis.origin, axis.bin_s) == (1000.0, 10)  # 100 s span: 10 s bins
    first = throughput(a1, axis)
    # 90 tokens in the first 10 s = 540 per minute; nothing until 1070 (bin 7).
    assert first.first_bin == 0
    assert first.tokens_per_minute == [540.0, 0, 0, 0, 0, 0, 0, 720.0]
    assert (first.stamped, first.unstamped) == (3, 0)
    second = throughput(b2, axis)
    assert (second.first_bin, second.tokens_per_minute) == (10, [60.0])
    assert (second.stamped, second.unstamped) == (1, 1)


def test_throughput_bins_widen_with_the_span_and_old_journals_have_none() -> None:
    long_run = _journal([(0.0, 1), (3 * 3600.0, 1)])
    assert throughput_axis({"A1": long_run}).bin_s == 300  # 10800 s / 300 s = 36 bins
    old = _journal([(None, 5), (None, 7)])
    axis = throughput_axis({"A1": old})
    assert axis.origin is None
    series = throughput(old, axis)
    assert (series.stamped, series.unstamped, series.tokens_per_minute) == (0, 2, [])


def _write_records(path: Path, records: list[dict[str, Any]]) -> Path:
    """A ``{dataset}.records.parquet`` as the generate job writes it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    summarise(records).write_parquet(path)
    return path


def _journal_record(i: int, finished_at: float | None) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "id": f"p{i}",
        "prompt_hash": f"h{i}",
        "status": "ok",
        "usage": {"completion_tokens": 5, "prompt_tokens": 10},
        "turns": [_turn(5)],
    }
    if finished_at is not None:
        rec["finished_at"] = finished_at
    return rec


@pytest.mark.parametrize(
    ("stamps", "note"),
    [
        ([1.0, 2.0], None),
        ([None, None], "journal predates timestamps (no finished_at)"),
        ([None, 2.0], "1 older records without finished_at"),
    ],
)
def test_the_journal_says_when_it_predates_timestamps(tmp_path, stamps, note) -> None:
    records = _write_records(
        tmp_path / "A1.records.parquet", [_journal_record(i, at) for i, at in enumerate(stamps)]
    )
    summary, said = load_journal(records)
    assert summary.height == 2
    assert said == note


def test_shard_tokens_and_the_cap_from_shard_bytes() -> None:
    manifest = {"shards": [{"tokens": 100, "samples": 4}, {"tokens": 90, "samples": 3}]}
    shards = shard_tokens(manifest, {"bytes_per_token": 10}, shard_bytes=1005)
    assert shards.tokens == [100, 90] and shards.samples == [4, 3]
    assert shards.cap_tokens == 100
    assert shard_tokens(manifest, {}, shard_bytes=1005).cap_tokens is None


def _fake_dataset(root: Path, dataset: str, rows: list[dict[str, Any]], budget: int) -> None:
    """The files the report reads, as the pipeline writes them, for one dataset."""
    records = [_journal_record(i, 1000.0 + 30 * i) for i in range(len(rows))]
    _write_jsonl(root / f"results/responses/{dataset}.jsonl", rows)
    _write_records(root / f"results/responses/{dataset}.records.parquet", records)
    completion = sum(r["usage"]["completion_tokens"] for r in rows)
    stats = {
        "prompts": len(rows) + 2,
        "in_output": len(rows),
        "failed": 0,
        "beyond_limits": 2,
        "skipped_input": 0,
        "stop_reason": "token_budget",
        "token_budget": budget,
        "completion_tokens": completion,
        "waste_tokens": 4,
    }
    (root / f"results/responses/{dataset}.stats.json").write_text(json.dumps(stats))
    tok = root / f"results/tokenized/{dataset}.stats.json"
    tok.parent.mkdir(parents=True, exist_ok=True)
    tok.write_text(json.dumps({"tokens": 120, "loss_tokens": 40, "dropped": [], "truncated": 0}))
    shard_dir = root / f"results/hidden_states/{dataset}"
    shard_dir.mkdir(parents=True, exist_ok=True)
    shards = [{"tokens": 70, "samples": 2}, {"tokens": 50, "samples": 1}] if rows else []
    manifest = {"shards": shards, "num_shards": len(shards), "num_tokens": 120, "bytes": 9000}
    (shard_dir / "manifest.json").write_text(json.dumps(manifest))
    (shard_dir / "plan.json").write_text(json.dumps({"bytes_per_token": 10}))


def _build(root: Path, datasets: list[str], out: str) -> dict[str, Path]:
    images = {name: root / out / f"{name}.png" for name in FIGURES}
    build_report(
        datasets=datasets,
        responses=[str(root / f"results/responses/{d}.jsonl") for d in datasets],
        response_stats=[str(root / f"results/responses/{d}.stats.json") for d in datasets],
        records=[str(root / f"results/responses/{d}.records.parquet") for d in datasets],
        tokenize_stats=[str(root / f"results/tokenized/{d}.stats.json") for d in datasets],
        plans=[str(root / f"results/hidden_states/{d}/plan.json") for d in datasets],
        manifests=[str(root / f"results/hidden_states/{d}/manifest.json") for d in datasets],
        shard_bytes=800,
        out_images={k: str(v) for k, v in images.items()},
        out_summary=str(root / out / "summary.html"),
    )
    return images


def test_build_report_writes_sized_deterministic_pictures_and_a_summary(tmp_path) -> None:
    datasets = ["A1", "B1", "B2", "Z0"]
    for name in datasets[:3]:
        _fake_dataset(tmp_path, name, ROWS, budget=30)
    _fake_dataset(tmp_path, "Z0", [], budget=0)  # a zero budget: empty but complete
    images = _build(tmp_path, datasets, "first")
    for name, path in images.items():
        width, height = figure_size(name, len(datasets))
        with Image.open(path) as img:
            assert img.format == "PNG"
            assert img.size == (round(width * DPI), round(height * DPI)), name
            assert img.getextrema() != ((255, 255), (255, 255), (255, 255), (255, 255))
    again = _build(tmp_path, datasets, "second")
    for name in FIGURES:
        assert images[name].read_bytes() == again[name].read_bytes(), f"{name} not reproducible"
    page = (tmp_path / "first/summary.html").read_text()
    assert page == (tmp_path / "second/summary.html").read_text()
    assert page.count("data:image/png;base64,") == len(FIGURES)
    for name in datasets:
        assert f'<table id="{name}">' in page
    # A1: 24 completion tokens of a 30-token budget, 1 of 3 rows with finish_reason length.
    assert "24 (80.0%)" in page and "1 (33.3%)" in page
    # Three 5-token records journaled 30 s apart.
    assert "15 tokens in 1m00s (15 per minute)" in page


def _overlaps(a: Any, b: Any) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.parametrize("n", [1, 3])
def test_the_budget_legend_covers_no_bar_and_no_numbers(n: int) -> None:
    # The last bar's numbers end where the legend used to sit (lower right, inside).
    bars = [BudgetBar(f"B{i}", BudgetUse(900 + i, 150, 1000), "token_budget") for i in range(n - 1)]
    bars.append(BudgetBar("B9", BudgetUse(400, 2500, 1000), None))
    fig = budget_use_figure(bars)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    [legend] = fig.legends
    box = legend.get_window_extent(renderer)
    [ax] = fig.axes
    covered = [t.get_text() for t in ax.texts if _overlaps(box, t.get_window_extent(renderer))]
    covered += [p.get_label() for p in ax.patches if _overlaps(box, p.get_window_extent(renderer))]
    assert covered == []
    assert "not decided yet" in ax.texts[-1].get_text()  # a running dataset's bar


def test_the_cancelled_decode_is_shown_beside_the_waste() -> None:
    stats = {"abandoned_requests": 12, "abandoned_tokens": 1204, "abandoned_tokens_estimated": 300}
    assert cancelled_text(stats) == "1,204 tokens in 12 requests (300 estimated)"
    exact = {**stats, "abandoned_tokens_estimated": 0}
    assert cancelled_text(exact) == "1,204 tokens in 12 requests"
    assert cancelled_text({"waste_tokens": 5}).startswith("n/a")


def test_the_budget_picture_says_what_cancelled_requests_wasted() -> None:
    stats = {"completion_tokens": 900, "waste_tokens": 150, "token_budget": 1000}
    use = budget_use({**stats, "abandoned_tokens": 40, "abandoned_tokens_estimated": 10})
    assert (use.abandoned_tokens, use.abandoned_tokens_estimated) == (40, 10)
    assert waste_text(use) == "150 waste (~40 cancelled)"
    assert waste_text(BudgetUse(900, 150, 1000, 40)) == "150 waste (40 cancelled)"
    # Stats written before cancelled requests were counted: the waste alone.
    assert waste_text(budget_use(stats)) == "150 waste"


def test_the_budget_numbers_stay_inside_the_picture() -> None:
    """Long numbers right of a long bar: the axis widens until they end inside it."""
    bars = [
        BudgetBar("A1", BudgetUse(1_999_950, 412_345, 2_000_000, 123_456, 4_000), "token_budget"),
        BudgetBar("B2", BudgetUse(400_000, 25_000_000, 1_000_000, 20_000_000, 10), None),
        BudgetBar("C3", BudgetUse(5, 7, None, 3), "exhausted"),
    ]
    fig = budget_use_figure(bars)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    [ax] = fig.axes
    assert [t.get_text().split("; ")[0].rsplit(" + ", 1)[-1] for t in ax.texts] == [
        "412,345 waste (~123,456 cancelled)",
        "25,000,000 waste (~20,000,000 cancelled)",
        "no token_budget: 5 tokens, 7 waste (3 cancelled)",
    ]
    for text in ax.texts:
        assert text.get_window_extent(renderer).x1 <= fig.bbox.x1, text.get_text()


def test_a_journal_summary_of_an_older_layout_is_read(tmp_path) -> None:
    """records.parquet written before abandoned records existed: none of its rows is one."""
    path = _write_records(tmp_path / "A1.records.parquet", [_journal_record(0, 1.0)])
    pl.read_parquet(path).drop("abandoned", "spent_estimated").write_parquet(path)
    summary, _ = load_journal(path)
    assert summary.schema == pl.Schema(SUMMARY_SCHEMA)
    assert (summary["abandoned"].to_list(), summary["spent_estimated"].to_list()) == ([False], [0])


def test_the_report_shows_the_cancelled_decode_beside_the_waste(tmp_path) -> None:
    """The generate job's stats and records of a dataset whose run cancelled requests in
    flight: the table says what they wasted, and the rate counts their decode."""
    _fake_dataset(tmp_path, "A1", ROWS, budget=30)
    responses = tmp_path / "results/responses"
    records = [_journal_record(i, 1000.0 + 30 * i) for i in range(len(ROWS))]
    cancelled = [
        {"id": "p3", "prompt_hash": "h3", "status": "abandoned", "completion_tokens_spent": 7,
         "spent_source": "estimate", "finished_at": 1050.0},
        {"id": "p4", "prompt_hash": "h4", "status": "abandoned", "completion_tokens_spent": 5,
         "spent_source": "server", "finished_at": 1060.0},
    ]  # fmt: skip
    _write_records(responses / "A1.records.parquet", records + cancelled)
    stats = json.loads((responses / "A1.stats.json").read_text())
    stats.update(waste_tokens=4 + 12, abandoned_requests=2, abandoned_tokens=12,
                 abandoned_tokens_estimated=7)  # fmt: skip
    (responses / "A1.stats.json").write_text(json.dumps(stats))
    report = load_dataset(
        "A1",
        responses=responses / "A1.jsonl",
        response_stats=responses / "A1.stats.json",
        tokenize_stats=tmp_path / "results/tokenized/A1.stats.json",
        records=responses / "A1.records.parquet",
        plan=tmp_path / "results/hidden_states/A1/plan.json",
        manifest=tmp_path / "results/hidden_states/A1/manifest.json",
        shard_bytes=800,
    )
    rows = dict(summary_rows(report))
    assert rows["waste tokens"] == "16 (53.3%)"
    assert rows["of which cancelled in flight"] == "12 tokens in 2 requests (7 estimated)"
    # Three 5-token records and 12 cancelled tokens, journaled over 60 s.
    assert rows["generation"] == "27 tokens in 1m00s (27 per minute)"
    assert waste_text(report.budget) == "16 waste (~12 cancelled)"
