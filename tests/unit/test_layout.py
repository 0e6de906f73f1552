"""The results layout: one set of patterns for the rules and for code that reads a run."""

from __future__ import annotations

from pathlib import Path

from eagle3data import layout
from eagle3data.layout import Results


def test_patterns_are_filled_under_any_workflow_directory(tmp_path: Path) -> None:
    results = Results(tmp_path)
    assert results.path(layout.PROMPTS, dataset="B2") == tmp_path / "results/prompts/B2.parquet"
    assert (
        results.path(layout.SHARD, dataset="A1", shard=7)
        == tmp_path / "results/hidden_states/A1/shard-00007.h5"
    )
    assert results.path(layout.SHARD_SPEC, dataset="A1", shard="00007") == (
        tmp_path / "results/.work/shards/A1/shard-00007.json"
    )
    assert Results().path(layout.JOURNAL, dataset="A1", key="k") == Path(
        "results/.work/generate/A1/k.jsonl"
    )


def test_shard_files_and_numbers(tmp_path: Path) -> None:
    shard_dir = Results(tmp_path).path(layout.SHARD_DIR, dataset="A1")
    shard_dir.mkdir(parents=True)
    for name in ("shard-00001.h5", "shard-00000.h5", "plan.json", ".shard-00002.h5.x.tmp"):
        (shard_dir / name).touch()
    assert [p.name for p in Results(tmp_path).shard_files("A1")] == [
        "shard-00000.h5",
        "shard-00001.h5",
    ]
    assert layout.shard_number(Path("shard-00012.h5"), "h5") == 12
    assert layout.shard_number(Path("shard-00012.json"), "h5") is None
    assert layout.shard_number(Path("shard-x.h5"), "h5") is None
