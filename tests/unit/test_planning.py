"""Shard planning: byte-bounded shards in order, per-shard specs, the disk check, and
the jobs that trust the plan (extraction, validation)."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from support.settings import capture_settings

from eagle3data.hidden_states.extraction import length_batches
from eagle3data.hidden_states.planning import plan_shards


def test_length_batches_bound_padded_tokens_and_cover_every_sample() -> None:
    lengths = [5, 100, 30, 30, 7, 250, 1]
    batches = length_batches(lengths, batch_tokens=100)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        width = max(lengths[i] for i in b)
        assert width * len(b) <= 100 or len(b) == 1
    assert [5] in batches  # 250 tokens get a batch of their own


TOK_STATS = {"tokenizer_hash": "t", "chat_template_hash": "c", "max_seq_len": 4096}


def _tokenized(tmp_path: Path, lengths: list[int], name: str = "t", seed: int = 0) -> Path:
    """A tokenized parquet with its stats file, rows ``c0, c1, ...`` of ``lengths`` tokens."""
    path = tmp_path / f"{name}.parquet"
    pl.DataFrame(
        {
            "id": [f"c{i}" for i in range(len(lengths))],
            "num_tokens": lengths,
            "input_ids": [[(seed + i + j) % 50 for j in range(n)] for i, n in enumerate(lengths)],
            "loss_mask": [[j % 2 for j in range(n)] for n in lengths],
        },
        schema_overrides={"loss_mask": pl.List(pl.Int8)},
    ).write_parquet(path)
    path.with_suffix(".stats.json").write_text(json.dumps(TOK_STATS))
    return path


def test_plan_fails_early_when_the_disk_cannot_hold_the_shards(tmp_path: Path, monkeypatch) -> None:
    import shutil

    from eagle3data.errors import DiskSpaceError

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 8, "dtype": "bfloat16"}))
    tokenized = _tokenized(tmp_path, [1000, 1000])
    needed = 2000 * (4 * 8 * 2 + 5)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=needed - 1))
    out = tmp_path / "hs" / "plan.json"
    kwargs = dict(
        dataset="A1",
        tokenized_path=str(tokenized),
        tokenize_stats_path=str(tokenized.with_suffix(".stats.json")),
        model_path=str(model),
        capture=capture_settings(shard_bytes=10**9),
        out_plan=str(out),
        spec_dir=str(tmp_path / "specs"),
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
    tokenized = _tokenized(tmp_path, lengths)
    per_token = 4 * 8 * 2 + 5
    out = tmp_path / "plan.json"
    plan_shards(
        dataset="A1",
        tokenized_path=str(tokenized),
        tokenize_stats_path=str(tokenized.with_suffix(".stats.json")),
        model_path=str(model),
        capture=capture_settings(shard_bytes=30 * per_token),
        out_plan=str(out),
        spec_dir=str(tmp_path / "specs"),
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
    from eagle3data.hidden_states.validation import validate

    (tmp_path / "responses.jsonl").write_text("")
    from eagle3data.tokenization.table import write_tokenized

    write_tokenized(tmp_path / "t.parquet", {})
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


def _plan(tmp_path: Path, tokenized: Path, per_token_bytes: int) -> dict:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"hidden_size": 8, "dtype": "bfloat16"}))
    out = tmp_path / "hs" / "plan.json"
    plan_shards(
        dataset="A1",
        tokenized_path=str(tokenized),
        tokenize_stats_path=str(tokenized.with_suffix(".stats.json")),
        model_path=str(model),
        capture=capture_settings(shard_bytes=per_token_bytes * (4 * 8 * 2 + 5)),
        out_plan=str(out),
        spec_dir=str(tmp_path / "specs"),
    )
    return json.loads(out.read_text())


def _spec_files(tmp_path: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in (tmp_path / "specs").iterdir()}


def test_shard_specs_change_only_where_the_rows_do(tmp_path: Path) -> None:
    """A raised budget appends rows: the full shards before them keep their spec files
    untouched (so Snakemake does not extract them again); the last one changes."""
    lengths = [10, 20, 5, 40, 3, 3]
    plan = _plan(tmp_path, _tokenized(tmp_path, lengths), 30)
    assert len(plan["shards"]) == 4
    before = _spec_files(tmp_path)
    assert sorted(before) == [f"shard-{k:05d}.json" for k in range(4)]
    spec = json.loads(before["shard-00001.json"][1])
    assert spec["start"] == 2 and spec["end"] == 3 and spec["tokenizer_hash"] == "t"

    plan = _plan(tmp_path, _tokenized(tmp_path, [*lengths, 3, 30, 7]), 30)
    after = _spec_files(tmp_path)
    assert len(plan["shards"]) == 6
    assert {k: after[k] for k in before if k != "shard-00003.json"} == {
        k: v for k, v in before.items() if k != "shard-00003.json"
    }, "full shards before the new rows are not rewritten"
    assert after["shard-00003.json"] != before["shard-00003.json"], "the last shard grew"

    # Other tokens in one row (another chat template, say): only its shard changes.
    changed = _tokenized(tmp_path, [*lengths, 3, 30, 7], name="t2")
    frame = pl.read_parquet(changed)
    frame = frame.with_columns(
        pl.when(pl.col("id") == "c3")
        .then(pl.col("input_ids").list.reverse())
        .otherwise(pl.col("input_ids"))
    )
    frame.write_parquet(changed)
    _plan(tmp_path, changed, 30)
    again = _spec_files(tmp_path)
    assert [k for k in again if again[k] != after[k]] == ["shard-00002.json"]

    # A lowered budget: fewer shards, and the specs and shard files beyond them go.
    for k in range(6):
        (tmp_path / "hs" / f"shard-{k:05d}.h5").write_bytes(b"x")
    plan = _plan(tmp_path, _tokenized(tmp_path, lengths[:3], name="t3"), 30)
    assert len(plan["shards"]) == 2
    assert sorted(_spec_files(tmp_path)) == ["shard-00000.json", "shard-00001.json"]
    assert sorted(p.name for p in (tmp_path / "hs").glob("shard-*.h5")) == [
        "shard-00000.h5",
        "shard-00001.h5",
    ]


def test_a_shard_is_never_extracted_from_rows_its_spec_does_not_describe(tmp_path: Path) -> None:
    from eagle3data.errors import ValidationError
    from eagle3data.hidden_states.extraction import ShardJob, extract_shard

    tokenized = _tokenized(tmp_path, [10, 20, 5])
    _plan(tmp_path, tokenized, 30)
    _tokenized(tmp_path, [10, 20, 5], seed=1)  # the rows changed behind the plan's back
    with pytest.raises(ValidationError, match=r"A1 shard 0: .*shard-00000\.json does not describe"):
        job = ShardJob(
            dataset="A1",
            shard=0,
            spec_path=str(tmp_path / "specs" / "shard-00000.json"),
            tokenized_path=str(tokenized),
            tokenize_stats_path=str(tokenized.with_suffix(".stats.json")),
            out_shard=str(tmp_path / "hs" / "shard-00000.h5"),
            model_path=str(tmp_path / "model"),
            model_label="m",
        )
        extract_shard(job, capture_settings())
    assert not (tmp_path / "hs" / "shard-00000.h5").exists()


def test_sample_ids_are_checked_against_the_responses() -> None:
    from eagle3data.hidden_states.validation import sample_id_errors

    def rows(*samples: tuple[int, str, int | None]) -> pl.DataFrame:
        index, ids, turns = zip(*samples, strict=True)
        schema = {"index": pl.UInt32, "id": pl.String, "turn": pl.UInt32}
        return pl.DataFrame({"index": index, "id": ids, "turn": turns}, schema=schema)

    responses = ["a", "b", "c"]
    dropped_c = [{"id": "c", "index": 2, "reason": "truncated"}]
    # a whole, b per turn with one of its samples dropped, c dropped entirely.
    good = rows((0, "a", None), (1, "b#3", 3))
    assert sample_id_errors(good, responses, [*dropped_c, {"id": "b#1", "index": 1}]) == []
    assert "neither tokenized nor recorded" in sample_id_errors(good, responses, [])[0]
    assert "does not belong" in sample_id_errors(rows((0, "b", None)), ["a"], [])[0]
    assert "not unique" in sample_id_errors(rows((0, "a", None), (0, "a", None)), ["a"], [])[0]
    swapped = rows((1, "b", None), (0, "a", None))
    assert "not in response order" in sample_id_errors(swapped, ["a", "b"], [])[0]


def test_the_rows_digest_covers_images_and_leaves_text_rows_as_they_were() -> None:
    """Another picture is other states, so it is another shard; a text row hashes as
    before the ``images`` column existed (an upgrade redoes no shard)."""
    from eagle3data.hidden_states.planning import rows_digest

    base = {"id": ["a"], "num_tokens": [3], "input_ids": [[1, 9, 2]], "loss_mask": [[0, 0, 1]]}
    text = pl.DataFrame(base)
    assert rows_digest(text) == rows_digest(pl.DataFrame({**base, "images": [[]]}))
    red, green = ("0" * 64,), ("1" * 64,)
    with_red = rows_digest(pl.DataFrame({**base, "images": [list(red)]}))
    assert with_red != rows_digest(text)
    assert with_red != rows_digest(pl.DataFrame({**base, "images": [list(green)]}))
