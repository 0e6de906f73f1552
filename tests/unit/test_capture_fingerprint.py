"""The capture fingerprint: every shard says what made its states, and a dataset whose shards
disagree is refused by the validator and the loader (so by every export and the draft
check), naming the fields that differ."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from eagle3data.errors import ShardFormatError
from eagle3data.hidden_states import fingerprint
from eagle3data.hidden_states.layers import resolve_aux_layers
from eagle3data.loader import HiddenStateDataset
from eagle3data.shards import ShardWriter

CAPTURE = {
    "engine": "vllm 0.32.0",
    "layout": "vllm server (its layout is not reported)",
    "weights_quantization": "none",
    "aux_layer_ids": [1, 3, 4],
    "aux_layers_confirmed_by": "the server's storage folder (eagle3data-layers-2-4-5-8)",
    "final_state": "pre_norm",
    "compute_dtype": "bfloat16",
    "tokenizer_hash": "t" * 16,
    "chat_template_hash": "c" * 16,
}


def write_shard(path: Path, capture: dict[str, Any] | None, first_id: int = 0) -> None:
    attrs = {**resolve_aux_layers("auto", 8, "layer_output").as_attrs(), "dataset": "A1"}
    if capture is not None:
        attrs[fingerprint.ATTR] = fingerprint.fingerprint_attr(capture)
    with ShardWriter(path, hidden_size=4, hidden_dtype="float32", attrs=attrs) as writer:
        for k in range(2):
            writer.add(
                f"s{first_id + k}", [1, 2, 3], [0, 1, 1], torch.zeros(3, 12), torch.ones(3, 4)
            )


def test_the_fingerprint_names_every_field_that_differs() -> None:
    other = {**CAPTURE, "engine": "sglang 0.5.23", "layout": "tp 8, dp 1, ep 1"}
    assert fingerprint.differences(CAPTURE, other) == [
        "engine: 'vllm 0.32.0' vs 'sglang 0.5.23'",
        "layout: 'vllm server (its layout is not reported)' vs 'tp 8, dp 1, ep 1'",
    ]
    assert fingerprint.differences(CAPTURE, dict(CAPTURE)) == []
    # Shards written before fingerprints say nothing: they differ from none.
    assert fingerprint.differences(None, None) == []
    assert fingerprint.differences(CAPTURE, None) == []
    with pytest.raises(ValueError, match="lacks"):
        fingerprint.fingerprint_attr({"engine": "x"})
    line = fingerprint.describe(CAPTURE)
    assert line.startswith("vllm 0.32.0, vllm server") and "aux layers [1, 3, 4]" in line


def test_unvalidated_shards_of_two_captures_are_refused_by_the_loader(tmp_path: Path) -> None:
    write_shard(tmp_path / "shard-00000.h5", CAPTURE)
    write_shard(tmp_path / "shard-00001.h5", {**CAPTURE, "aux_layer_ids": [2, 4, 6]}, 2)
    with pytest.raises(ShardFormatError) as caught:
        HiddenStateDataset(tmp_path)
    message = str(caught.value)
    assert "shard-00001.h5: captured otherwise than" in message
    assert "aux_layer_ids: [1, 3, 4] vs [2, 4, 6]" in message


def test_a_run_upgraded_midway_keeps_the_shards_it_made_before_fingerprints(
    tmp_path: Path,
) -> None:
    """Shards of a build before fingerprints beside shards of this one: read as one dataset
    (nothing says they differ); two fingerprinted shards that differ still do not."""
    write_shard(tmp_path / "shard-00000.h5", None)
    write_shard(tmp_path / "shard-00001.h5", CAPTURE, 2)
    assert len(HiddenStateDataset(tmp_path)) == 4
    write_shard(tmp_path / "shard-00002.h5", {**CAPTURE, "final_state": "post_norm"}, 4)
    with pytest.raises(
        ShardFormatError,
        match=r"shard-00002\.h5: captured otherwise than .*"
        r"shard-00001\.h5 \(final_state: 'pre_norm' vs 'post_norm'\)",
    ):
        HiddenStateDataset(tmp_path)


def test_a_shard_that_is_not_what_its_manifest_says_is_refused_when_read(tmp_path: Path) -> None:
    """A shard re-made with another engine after validation (the engine is a setting of
    how to run, so changing it re-extracts nothing by itself)."""
    write_shard(tmp_path / "shard-00000.h5", CAPTURE)
    write_shard(tmp_path / "shard-00001.h5", CAPTURE, 2)
    manifest = {
        "dataset": "A1",
        "shards": [
            {"file": "shard-00000.h5", "samples": 2},
            {"file": "shard-00001.h5", "samples": 2},
        ],
        "attrs": {fingerprint.ATTR: fingerprint.fingerprint_attr(CAPTURE)},
    }
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert [item["id"] for item in HiddenStateDataset(tmp_path)] == ["s0", "s1", "s2", "s3"]
    write_shard(tmp_path / "shard-00001.h5", {**CAPTURE, "engine": "transformers 5.23.0"}, 2)
    data = HiddenStateDataset(tmp_path)
    assert data[0]["id"] == "s0"
    with pytest.raises(ShardFormatError, match=r"engine: 'vllm 0\.32\.0' vs 'transformers"):
        data[2]


def test_the_status_prints_each_validated_datasets_capture(tmp_path: Path) -> None:
    from dataclasses import fields

    from eagle3data.layout import MANIFEST, Results
    from eagle3data.monitor.snapshot import DatasetStatus, _capture, capture_lines

    results = Results(tmp_path)
    assert _capture(results, "A1") is None  # not validated yet
    manifest = results.path(MANIFEST, dataset="A1")
    manifest.parent.mkdir(parents=True)
    manifest.write_text(
        json.dumps({"attrs": {fingerprint.ATTR: fingerprint.fingerprint_attr(CAPTURE)}})
    )
    said = _capture(results, "A1")
    assert said == fingerprint.describe(CAPTURE)
    blank = {f.name: None for f in fields(DatasetStatus)}
    rows = [
        DatasetStatus(**{**blank, "dataset": "A1", "capture": said}),
        DatasetStatus(**{**blank, "dataset": "B2"}),
    ]
    assert capture_lines(rows) == ["Captured with (validated shards):", f"  A1: {said}"]
    assert capture_lines(rows[1:]) == []
