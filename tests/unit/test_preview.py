"""The dry run's hidden-state estimate before anything is generated (the later bases,
decided and extrapolated, are checked on a real run in test_workflow.py)."""

from __future__ import annotations

import json
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from eagle3data.config import PACKAGE_SCHEMA, validate_config
from eagle3data.layout import Results
from eagle3data.monitor import preview


def _config(model_dir: Path, **datasets: dict) -> dict:
    config = {
        "model": {"path": str(model_dir), "dtype": "auto"},
        "hidden_states": {"dtype": "auto", "max_seq_len": 2048},
        "datasets": {name: {"path": f"{name}.jsonl", **d} for name, d in datasets.items()},
    }
    return validate_config(config, PACKAGE_SCHEMA)  # as the status command loads it


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"hidden_size": 7168, "dtype": "bfloat16"}))
    return out


def test_before_generation_the_budget_is_a_lower_bound(tmp_path, model_dir) -> None:
    config = _config(model_dir, A1={"token_budget": 1_000_000}, B2={"max_samples": 10})
    a1 = preview.estimate_hidden_states(config, "A1", Results(tmp_path))
    # Kimi-K2.5's width in bf16: (3 + 1) x 7168 x 2 bytes + int32 id + uint8 mask.
    assert a1.bytes_per_token == 57_349
    assert (a1.basis, a1.tokens, a1.bytes) == ("lower bound", 1_000_000, 57_349_000_000)
    b2 = preview.estimate_hidden_states(config, "B2", Results(tmp_path))
    assert (b2.basis, b2.tokens, b2.bytes) == ("unknown", None, None)

    lines = preview.preview_lines(config, Results(tmp_path))
    assert "  A1: at least 1000000 tokens x 57349 B = at least 57.3 GB (lower bound)" in lines
    assert "  B2: unknown until something is generated (no token_budget) (unknown)" in lines
    assert any(line.startswith("  total: 57.3 GB; free on ") for line in lines)


def test_a_disk_too_small_is_called_out(tmp_path, model_dir, monkeypatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: usage(10**9, 0, 10**9))
    config = _config(model_dir, A1={"token_budget": 1_000_000})
    lines = preview.preview_lines(config, Results(tmp_path))
    assert lines[-1] == "  WARNING: the hidden states will not fit on this disk"


def test_a_model_not_converted_yet_gives_no_bytes(tmp_path) -> None:
    config = _config(tmp_path / "not-yet", A1={"token_budget": 100})
    lines = preview.preview_lines(config, Results(tmp_path))
    assert lines[1:] == [
        "  A1: nothing generated yet; up to 100 completion tokens",
        "Hidden-state estimate (from the files on disk):",
        "  A1: unknown until the model directory exists",
    ]


def test_fp8_storage_halves_the_estimate(tmp_path, model_dir) -> None:
    config = _config(model_dir, A1={"token_budget": 1_000_000})
    bf16 = preview.estimate_hidden_states(config, "A1", Results(tmp_path)).bytes_per_token
    config["hidden_states"]["storage_dtype"] = "float8_e4m3fn"
    fp8 = preview.estimate_hidden_states(config, "A1", Results(tmp_path)).bytes_per_token
    # FP8 values plus one float32 scale per token per 128 channels (4 x 56 blocks).
    assert fp8 == 4 * 7168 + 4 * 4 * 56 + 5
    assert fp8 / bf16 < 0.52
