"""The demo's settings pass the agreement check end to end: SmolLM2 generating greedily in
bfloat16 (its checkpoint dtype), hidden states in float32, validate with the default
thresholds; the manifest carries the agreement and its control, and status shows them."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from support.workflow import new_workflow, sharegpt_prompts, write_prompts

from eagle3data.config import validate_config
from eagle3data.layout import Results
from eagle3data.monitor.snapshot import agreement_cell, token_ids_cell
from eagle3data.monitor.status import snapshots

pytestmark = pytest.mark.e2e


def test_the_demo_model_agrees_with_its_own_tokens(tmp_path: Path, smollm2_dir: Path) -> None:
    prompts = write_prompts(tmp_path / "A1.jsonl", sharegpt_prompts(6))
    wf = new_workflow(
        tmp_path,
        smollm2_dir,
        {"A1": {"path": str(prompts), "format": "sharegpt"}},
        generation={
            "batch_size": 6,
            "progress_interval_s": 0,
            "sampling": {"temperature": 0.0, "max_tokens": 48},
        },
        hidden_states={"dtype": "float32", "max_seq_len": 1024, "batch_tokens": 2048},
        validate={"agreement": {"enabled": True}},  # the default, on a real model
    )
    wf.run("results/hidden_states/A1/manifest.json")
    manifest = json.loads(wf.path("results/hidden_states/A1/manifest.json").read_text())
    check = manifest["agreement"]
    assert check["greedy"] and check["judged_by"] == "agreement"
    assert check["positions"] > 50  # 158 here: six answers of up to 48 tokens
    # The demo measures 0.96-0.98 (bf16 generation, float32 states): well above the bar.
    assert check["agreement"] > 0.85 and check["control_agreement"] < 0.1
    assert check["mean_logprob"] > check["control_mean_logprob"] + 4
    assert [s["positions"] for s in check["shards"]] and check["settings"]["min_agreement"] == 0.8
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
