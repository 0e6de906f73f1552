"""The prompts stage run by Snakemake on the formats the Hub ships: a Parquet folder of
shards, a datasets.save_to_disk folder and gzipped JSON Lines give the same rows as the
equivalent JSON Lines file."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import polars as pl
import pytest
from support.workflow import new_workflow, sharegpt_prompts

ROW_CONTENT = ["index", "id", "prompt_hash", "messages", "tools"]


def _sources(tmp_path: Path, records: list[dict]) -> dict[str, dict]:
    jsonl = tmp_path / "plain.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    gz = tmp_path / "plain.jsonl.gz"
    gz.write_bytes(gzip.compress(jsonl.read_bytes()))
    shards = tmp_path / "parquet" / "data"
    shards.mkdir(parents=True)
    half = len(records) // 2
    for k, part in enumerate((records[:half], records[half:])):
        pl.DataFrame(part).write_parquet(shards / f"train-{k:05d}-of-00002.parquet")
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(records).save_to_disk(str(saved))
    return {
        "JSONL": {"path": str(jsonl)},
        "GZ": {"path": str(gz)},
        "PARQUET": {"path": str(tmp_path / "parquet")},
        "DISK": {"path": str(saved)},
    }


def test_every_format_gives_the_rows_of_the_equivalent_jsonl(tmp_path: Path) -> None:
    records = sharegpt_prompts(12)
    for r in records:  # Parquet needs one schema: give every turn list the same keys
        r["system"] = None
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    wf = new_workflow(tmp_path, model, _sources(tmp_path, records))
    targets = [f"results/prompts/{name}.parquet" for name in wf.config["datasets"]]
    wf.run(*targets)
    tables = {
        name: pl.read_parquet(wf.path(f"results/prompts/{name}.parquet")).select(ROW_CONTENT)
        for name in wf.config["datasets"]
    }
    reference = tables.pop("JSONL")
    assert reference.height == 12
    for name, table in tables.items():
        assert table.equals(reference), name
