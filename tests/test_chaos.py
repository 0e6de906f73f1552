"""Chaos: kill the whole workflow at random moments with SIGINT, SIGTERM or SIGKILL,
re-run the README's command until it finishes, and compare every file with an
uninterrupted run's. Seeded, so a failure can be replayed (CHAOS_SEED=...)."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import polars as pl
import pytest
from conftest import Workflow, alpaca_prompts, kill_group, sharegpt_prompts, write_prompts

from eagle3data.shards import open_shard, validate_shard

pytestmark = [pytest.mark.e2e, pytest.mark.chaos]

SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGKILL]


def _datasets(tmp_path: Path) -> dict[str, dict]:
    a1 = write_prompts(tmp_path / "A1.jsonl", sharegpt_prompts(40))
    b2 = write_prompts(tmp_path / "B2.jsonl", alpaca_prompts(30))
    return {
        "A1": {"path": str(a1), "format": "sharegpt", "token_budget": 160},
        "B2": {"path": str(b2), "format": "alpaca", "max_samples": 12},
    }


def _shard_contents(wf: Workflow, ds: str) -> list[tuple]:
    out = []
    for path in sorted(wf.path(f"results/hidden_states/{ds}").glob("shard-*.h5")):
        assert validate_shard(path).ok, path
        with open_shard(path) as shard:
            out.append(
                (
                    path.name,
                    shard.sample_ids,
                    shard.input_ids.tolist(),
                    shard.loss_mask.tolist(),
                    shard.aux_hidden_states().tobytes(),
                    shard.last_hidden_states().tobytes(),
                )
            )
    return out


def _running_stage(wf: Workflow) -> str:
    """The rule whose log was written last: what the kill interrupted."""
    logs = [p for p in wf.path("logs").rglob("*.log")] if wf.path("logs").exists() else []
    if not logs:
        return "startup"
    newest = max(logs, key=lambda p: p.stat().st_mtime)
    return newest.relative_to(wf.path("logs")).parts[0]


def test_random_kills_at_every_stage_change_nothing(make_workflow, tmp_path: Path) -> None:
    seed = int(os.environ.get("CHAOS_SEED", "20261130"))
    rng = random.Random(seed)
    datasets = _datasets(tmp_path)
    reference = make_workflow(datasets, name="reference", generation={"batch_size": 2})
    start = time.monotonic()
    reference.run()
    duration = time.monotonic() - start

    wf = make_workflow(datasets, name="chaos", generation={"batch_size": 2})
    kills = []
    for k in range(10):
        sig = rng.choice(SIGNALS)
        # Later kills wait longer: finished work is kept, so each run gets further
        # and the kills move from generation to the later stages.
        delay = rng.uniform(1.5, 6.0) + k * duration / 30
        proc = wf.start()
        time.sleep(delay)
        if proc.poll() is not None:
            break  # finished before this kill: the workflow is complete
        stage = _running_stage(wf)
        code = kill_group(proc, sig)
        kills.append((sig.name, round(delay, 1), stage, code))
        if sig == signal.SIGKILL:
            wf.run("--unlock")
    wf.run()
    assert len(kills) >= 6, f"too few kills landed (seed {seed}): {kills}"
    stages = {k[2] for k in kills}
    assert len(stages) >= 2, f"kills should hit several stages (seed {seed}): {kills}"
    assert wf.plans_nothing()

    for ds in datasets:
        for rel in (f"results/responses/{ds}.jsonl", f"results/prompts/{ds}.skipped.jsonl"):
            assert wf.path(rel).read_bytes() == reference.path(rel).read_bytes(), (rel, kills)
        ours = pl.read_parquet(wf.path(f"results/tokenized/{ds}.parquet"))
        theirs = pl.read_parquet(reference.path(f"results/tokenized/{ds}.parquet"))
        assert ours.equals(theirs), (ds, kills)
        assert _shard_contents(wf, ds) == _shard_contents(reference, ds), (ds, kills)
        manifest = json.loads(wf.path(f"results/hidden_states/{ds}/manifest.json").read_text())
        want = json.loads(reference.path(f"results/hidden_states/{ds}/manifest.json").read_text())
        assert [s["samples"] for s in manifest["shards"]] == [s["samples"] for s in want["shards"]]
        ids = [json.loads(line)["id"] for line in wf.journal_lines(ds)]
        assert len(ids) == len(set(ids)), "no prompt journaled twice"
