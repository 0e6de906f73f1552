"""The demo's settings pass the agreement check end to end: SmolLM2 generating greedily in
bfloat16 (its checkpoint dtype), hidden states in float32, validate with the default
thresholds; the manifest carries the agreement and its control, and status shows them.

The run is the session's ``exported_run`` (tests/conftest.py), shared with the trainers'
tests: the same settings, with the exports on and every position scored, which on these
few positions is what the default (2048 per shard) scores too (asserted below)."""

from __future__ import annotations

import copy
import json

import pytest
from support.exported_run import ExportedRun

from eagle3data.config import validate_config
from eagle3data.hidden_states.agreement import AgreementSettings
from eagle3data.layout import Results
from eagle3data.monitor.snapshot import agreement_cell, token_ids_cell
from eagle3data.monitor.status import snapshots

pytestmark = pytest.mark.e2e


def test_the_demo_model_agrees_with_its_own_tokens(exported_run: ExportedRun) -> None:
    wf = exported_run.workflow
    manifest = json.loads(wf.path("results/hidden_states/A1/manifest.json").read_text())
    check = manifest["agreement"]
    assert check["greedy"] and check["judged_by"] == "agreement"
    assert check["positions"] > 50  # 158 here: six answers of up to 48 tokens
    # The demo measures 0.96-0.98 (bf16 generation, float32 states): well above the bar.
    assert check["agreement"] > 0.85 and check["control_agreement"] < 0.1
    assert check["mean_logprob"] > check["control_mean_logprob"] + 4
    assert [s["positions"] for s in check["shards"]] and check["settings"]["min_agreement"] == 0.8
    # Scored all: the default sample (2048 per shard) would have taken these same positions.
    default_count = AgreementSettings().positions_per_shard
    assert all(s["positions"] <= default_count for s in check["shards"])
    assert any("agrees with the tokens it generated" in c for c in manifest["checks"])

    config = validate_config(copy.deepcopy(wf.config), wf.root / "config" / "schema.yaml")
    (row,) = [s.status for s in snapshots(config, Results(wf.root), now=0.0)]
    assert agreement_cell(row.agreement) == (
        f"{check['agreement']:.2f}/{check['control_agreement']:.2f}"
    )
    # Trained on the in-process engine's own ids; the status says how many of those turns
    # the template re-renders identically.
    ids = manifest["token_ids"]
    turns = sum(len(r["turns"]) for r in wf.responses("A1"))
    assert ids["turns_from_engine_ids"] == turns and ids["turns_from_rerender"] == 0
    assert ids["identical_to_rerender"] + ids["differ_from_rerender"] == turns
    assert token_ids_cell(row.token_ids) == f"{ids['identical_to_rerender']}/{turns}"
