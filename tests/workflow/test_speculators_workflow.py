"""The workflow's speculators export: every dataset in one training folder that speculators'
own dataset code reads, checked by the job against the manifests before it appears."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.workflow import Workflow, alpaca_prompts, new_workflow, sharegpt_prompts, write_prompts

pytest.importorskip("speculators", reason="the README's test command installs speculators")

from speculators.train.data import ArrowDataset

pytestmark = pytest.mark.e2e


def test_the_workflow_exports_for_speculators_when_enabled(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    datasets = {
        "A1": {
            "path": str(write_prompts(tmp_path / "A1.jsonl", sharegpt_prompts(6))),
            "format": "sharegpt",
        },
        "B2": {
            "path": str(write_prompts(tmp_path / "B2.jsonl", alpaca_prompts(4))),
            "format": "alpaca",
        },
    }
    wf: Workflow = new_workflow(tmp_path, tiny_model_dir, datasets, draft_vocab={"size": 40})
    assert "export_speculators" not in wf.run("-n").stdout, "off by default"
    wf.config["export"] = {"speculators": True}
    wf.write_config()
    wf.run()
    out = wf.path("results/speculators")
    info = json.loads((out / "export.json").read_text())
    manifests = {
        d: json.loads(wf.path(f"results/hidden_states/{d}/manifest.json").read_text())
        for d in datasets
    }
    assert info["num_samples"] == sum(m["num_samples"] for m in manifests.values())
    assert info["target_layer_ids"] == manifests["A1"]["attrs"]["aux_hidden_states_indices"]
    assert "--data-path results/speculators " in info["train_command"]
    assert (
        len(ArrowDataset(max_len=4096, datapath=str(out), on_missing="raise"))
        == info["num_samples"]
    )
    assert (out / "d2t-40.npy").is_file() and (out / "t2d-40.npy").is_file()
    for d in datasets:
        # The workflow tests turn validate's agreement off (a random model): the job holds
        # speculators' teacher to our head over the shards' post-norm states instead.
        got = info["self_check"]["agreement"][d]
        assert got["manifest_agreement"] is None and got["positions"] > 0
        assert (
            abs(got["speculators_teacher_agreement"] - got["shards_agreement_same_positions"])
            <= 0.02
        )
    log = wf.path("logs/export_speculators/export_speculators.log").read_text()
    assert log.count("train with: speculators train") == 1
    assert wf.plans_nothing()
    assert not list(wf.path("results/.work/speculators").iterdir())
