"""Sidecar keys, model fingerprints, length batching and shard planning."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from eagle3data.extract import length_batches
from eagle3data.settings import (
    declared_dtype,
    generation_key,
    generation_settings,
    model_fingerprint,
)
from eagle3data.steps import plan_shards


def _config(**sampling) -> dict:
    return {
        "model": {"path": "m", "name": None, "dtype": "auto", "chat_template_kwargs": {}},
        "generation": {
            "backend": "transformers",
            "batch_size": 8,
            "seed": 0,
            "device": "auto",
            "progress_interval_s": 10,
            "sampling": {"temperature": 0.0, "max_tokens": 64, **sampling},
        },
        "datasets": {"A1": {"path": "a", "format": "sharegpt", "token_budget": 10}},
    }


def test_sidecar_key_ignores_budgets_and_logging_but_not_sampling() -> None:
    base = _config()
    key = generation_key(generation_settings(base), "fp")
    changed_budget = _config()
    changed_budget["datasets"]["A1"]["token_budget"] = 99
    changed_budget["generation"]["progress_interval_s"] = 1
    changed_budget["model"]["path"] = "elsewhere/m"
    assert generation_key(generation_settings(changed_budget), "fp") == key
    assert generation_key(generation_settings(_config(temperature=0.7)), "fp") != key
    assert generation_key(generation_settings(base), "other-model") != key


def test_model_fingerprint_follows_config_tokenizer_and_weight_sizes(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    first = model_fingerprint(tmp_path)
    (tmp_path / "model.safetensors").touch()  # same content, new mtime
    assert model_fingerprint(tmp_path) == first
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "x"}')
    second = model_fingerprint(tmp_path)
    assert second != first
    (tmp_path / "model.safetensors").write_bytes(b"x" * 11)
    assert model_fingerprint(tmp_path) != second


def test_declared_dtype_reads_either_key_and_vlm_wrappers() -> None:
    assert declared_dtype({"dtype": "bfloat16"}) == "bfloat16"
    assert declared_dtype({"torch_dtype": "float16"}) == "float16"
    assert declared_dtype({"text_config": {"torch_dtype": "bfloat16"}}) == "bfloat16"
    assert declared_dtype({}) == "float32"


def test_length_batches_bound_padded_tokens_and_cover_every_sample() -> None:
    lengths = [5, 100, 30, 30, 7, 250, 1]
    batches = length_batches(lengths, batch_tokens=100)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        width = max(lengths[i] for i in b)
        assert width * len(b) <= 100 or len(b) == 1
    assert [5] in batches  # 250 tokens get a batch of their own


def test_plan_fails_early_when_the_disk_cannot_hold_the_shards(tmp_path: Path, monkeypatch) -> None:
    import shutil

    from eagle3data.steps import DiskSpaceError

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 8, "dtype": "bfloat16"}))
    tokenized = tmp_path / "t.parquet"
    pl.DataFrame({"num_tokens": [1000, 1000]}).write_parquet(tokenized)
    needed = 2000 * (4 * 8 * 2 + 5)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=needed - 1))
    out = tmp_path / "hs" / "plan.json"
    kwargs = dict(
        dataset="A1",
        tokenized_path=str(tokenized),
        model_path=str(model),
        hidden_cfg={"dtype": "auto", "shard_bytes": 10**9},
        model_dtype="auto",
        out_plan=str(out),
    )
    with pytest.raises(
        DiskSpaceError, match=r"A1: the hidden states need about 138\.0 kB but only"
    ):
        plan_shards(**kwargs)
    assert not out.exists()
    # Shards about to be replaced count as free space.
    (out.parent / "shard-00000.h5").write_bytes(b"x" * 10)
    plan_shards(**kwargs)
    assert json.loads(out.read_text())["estimated_bytes"] == needed


def test_plan_shards_bounds_bytes_and_keeps_order(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 8, "dtype": "bfloat16"}))
    lengths = [10, 20, 5, 40, 3, 3]
    tokenized = tmp_path / "t.parquet"
    pl.DataFrame({"num_tokens": lengths}).write_parquet(tokenized)
    per_token = 4 * 8 * 2 + 5
    out = tmp_path / "plan.json"
    plan_shards(
        dataset="A1",
        tokenized_path=str(tokenized),
        model_path=str(model),
        hidden_cfg={"dtype": "auto", "shard_bytes": 30 * per_token},
        model_dtype="auto",
        out_plan=str(out),
    )
    plan = json.loads(out.read_text())
    assert plan["bytes_per_token"] == per_token and plan["hidden_dtype"] == "bfloat16"
    ranges = [(s["start"], s["end"]) for s in plan["shards"]]
    assert ranges == [(0, 2), (2, 3), (3, 4), (4, 6)]
    assert [s["shard"] for s in plan["shards"]] == [0, 1, 2, 3]
    for s in plan["shards"]:
        assert s["tokens"] == sum(lengths[s["start"] : s["end"]])
        assert s["tokens"] <= 30 or s["end"] - s["start"] == 1
    assert plan["estimated_bytes"] == sum(lengths) * per_token


def test_an_empty_dataset_validates_to_an_empty_manifest(tmp_path: Path) -> None:
    from eagle3data.steps import validate

    (tmp_path / "responses.jsonl").write_text("")
    pl.DataFrame({"id": []}, schema={"id": pl.String}).write_parquet(tmp_path / "t.parquet")
    (tmp_path / "t.stats.json").write_text(json.dumps({"dropped": [], "loss_tokens": 0}))
    (tmp_path / "plan.json").write_text(json.dumps({"shards": [], "hidden_size": 8}))
    validate(
        dataset="A1",
        responses_path=str(tmp_path / "responses.jsonl"),
        tokenized_path=str(tmp_path / "t.parquet"),
        tokenize_stats_path=str(tmp_path / "t.stats.json"),
        plan_path=str(tmp_path / "plan.json"),
        shard_paths=[],
        out_manifest=str(tmp_path / "manifest.json"),
    )
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["num_shards"] == manifest["num_samples"] == manifest["num_tokens"] == 0
