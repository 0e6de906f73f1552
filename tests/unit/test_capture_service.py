"""The capture engine's failures, from the shard job's side: an engine that cannot load
the target, and a shard that fails on a loaded engine, each end the job with one line,
and leave no engine and no state behind. (The engine at work: tests/workflow/
test_capture_engine.py.)"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from support.settings import capture_settings

from eagle3data.gpu_slots import GpuRequest
from eagle3data.hidden_states import capture_service
from eagle3data.hidden_states.capture_service import (
    CaptureEngineError,
    EngineSpec,
    capture_on_engine,
    owner_token,
)
from eagle3data.hidden_states.extraction import ShardJob

CAPTURE = capture_settings(device="cpu", dtype="float32", batch_tokens=512)


@pytest.fixture
def engines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "engines"
    monkeypatch.setenv(capture_service.ROOT_ENV, str(root))
    return root


def spec(model: Path, workdir: Path) -> EngineSpec:
    return EngineSpec(
        owner=owner_token(),  # this test process is the run
        model_path=str(model),
        capture=CAPTURE,
        threads=1,
        workdir=str(workdir),
        log_dir=str(workdir / "logs"),
        idle_s=60,
    )


def job(tmp_path: Path) -> ShardJob:
    """A shard job whose files are missing: the engine fails the shard, if it loads."""
    return ShardJob(
        dataset="A1",
        shard=0,
        spec_path=str(tmp_path / "missing-spec.json"),
        tokenized_path=str(tmp_path / "missing.parquet"),
        tokenize_stats_path=str(tmp_path / "missing.stats.json"),
        out_shard=str(tmp_path / "shard-00000.h5"),
        model_path=str(tmp_path / "model"),
        model_label="tiny",
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
        capture_on_engine(spec(tmp_path / "no-model", tmp_path), GpuRequest(0), job(tmp_path))
    assert "no-model" in str(failed.value) and "\n" not in str(failed.value)
    nothing_left(engines)


def test_a_failed_shard_fails_the_job_and_stops_the_engine(
    engines: Path, tmp_path: Path, tiny_model_dir: Path
) -> None:
    with pytest.raises(CaptureEngineError, match=r"missing-spec\.json"):
        capture_on_engine(spec(tiny_model_dir, tmp_path), GpuRequest(0), job(tmp_path))
    nothing_left(engines)
    assert not (tmp_path / "shard-00000.h5").exists()
    log = "".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
    assert "stops after a failed shard" in log
