"""The capture engine's failures, from the shard job's side: an engine that cannot load
the target, and a shard that fails on a loaded engine, each end the job with one line,
and leave no engine and no state behind. (The engine at work: tests/workflow/
test_capture_engine.py.)"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from eagle3data.gpu_slots import GpuRequest
from eagle3data.hidden_states import capture_service
from eagle3data.hidden_states.capture_service import (
    CaptureEngineError,
    EngineSpec,
    capture_on_engine,
    owner_token,
)

HIDDEN = {
    "backend": "transformers",
    "device": "cpu",
    "aux_layers": "auto",
    "aux_layer_convention": "layer_output",
    "dtype": "float32",
    "batch_tokens": 512,
}


@pytest.fixture
def engines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "engines"
    monkeypatch.setenv(capture_service.ROOT_ENV, str(root))
    return root


def spec(model: Path, workdir: Path) -> EngineSpec:
    return EngineSpec(
        owner=owner_token(),  # this test process is the run
        model_path=str(model),
        hidden_cfg=HIDDEN,
        model_dtype="float32",
        threads=1,
        workdir=str(workdir),
        log_dir=str(workdir / "logs"),
        idle_s=60,
    )


def nothing_left(root: Path) -> None:
    deadline = time.monotonic() + 60
    while any(root.glob("*/*-*-*")):
        assert time.monotonic() < deadline, list(root.glob("*/*"))
        time.sleep(0.1)


def test_an_engine_that_cannot_load_the_target_fails_the_job_in_one_line(
    engines: Path, tmp_path: Path
) -> None:
    with pytest.raises(CaptureEngineError) as failed:
        capture_on_engine(spec(tmp_path / "no-model", tmp_path), GpuRequest(0), {})
    assert "no-model" in str(failed.value) and "\n" not in str(failed.value)
    nothing_left(engines)


def test_a_failed_shard_fails_the_job_and_stops_the_engine(
    engines: Path, tmp_path: Path, tiny_model_dir: Path
) -> None:
    request: dict[str, Any] = {
        "dataset": "A1",
        "shard": 0,
        "spec_path": str(tmp_path / "missing-spec.json"),
        "tokenized_path": str(tmp_path / "missing.parquet"),
        "tokenize_stats_path": str(tmp_path / "missing.stats.json"),
        "model_path": str(tiny_model_dir),
        "model_label": "tiny",
        "hidden_cfg": HIDDEN,
        "model_dtype": "float32",
        "out_shard": str(tmp_path / "shard-00000.h5"),
    }
    with pytest.raises(CaptureEngineError, match=r"missing-spec\.json"):
        capture_on_engine(spec(tiny_model_dir, tmp_path), GpuRequest(0), request)
    nothing_left(engines)
    assert not (tmp_path / "shard-00000.h5").exists()
    log = "".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
    assert "stops after a failed shard" in log
