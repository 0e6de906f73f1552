"""The workflow's speculators export: every dataset in one training folder that speculators'
own dataset code reads, checked by the job against the manifests before it appears (the run
is tests/conftest.py's ``consumers_run``, shared with the other consumer rules' tests)."""

from __future__ import annotations

import json

import pytest
from support.exported_run import ConsumersRun

pytest.importorskip("speculators", reason="the README's test command installs speculators")

from speculators.train.data import ArrowDataset

pytestmark = pytest.mark.e2e


def test_the_workflow_exports_for_speculators_when_enabled(consumers_run: ConsumersRun) -> None:
    wf = consumers_run.workflow
    datasets = wf.config["datasets"]
    assert set(datasets) == {"A1", "B2"} and wf.config["draft_vocab"]["size"] == 40
    assert "export_speculators" not in consumers_run.dry_run, "off by default"
    assert consumers_run.exports["speculators"]  # then turned on: built with the shards
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
