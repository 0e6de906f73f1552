"""The consumer rules in the workflow: the draft vocabulary over all datasets, and the
optional SpecForge export of the validated shards (one run of them, tests/conftest.py's
``consumers_run``, shared with the speculators export's test)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import polars as pl
import pytest
import torch
from specforge.core.compact_teacher import validate_vocab_mapping_consistency
from support.exported_run import ConsumersRun
from support.oracles import reference_ids

from eagle3data.consumers.specforge import specforge_file_name
from eagle3data.hidden_states.final_state import load_final_norm
from eagle3data.shards import open_shard

pytestmark = pytest.mark.e2e


def test_the_default_target_builds_the_vocab_over_all_datasets(
    consumers_run: ConsumersRun, tiny_model_dir: Path
) -> None:
    wf = consumers_run.workflow
    datasets = wf.config["datasets"]
    assert set(datasets) == {"A1", "B2"}
    assert "draft_vocab" in consumers_run.dry_run
    # results/vocab/draft_vocab.pt alone needs only the tokenized data:
    assert consumers_run.manifests_after_vocab == []
    counts: Counter[int] = Counter()
    for ds in datasets:
        df = pl.read_parquet(wf.path(f"results/tokenized/{ds}.parquet"))
        for ids, mask in zip(df["input_ids"].to_list(), df["loss_mask"].to_list(), strict=True):
            counts.update(t for t, m in zip(ids, mask, strict=True) if m)
    vocab_size = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    want = reference_ids(counts, 40, vocab_size)
    mapping = torch.load(wf.path("results/vocab/draft_vocab.pt"), weights_only=True)
    assert mapping["t2d"].shape == (vocab_size,)
    assert mapping["t2d"].nonzero().flatten().tolist() == want
    validate_vocab_mapping_consistency(mapping["t2d"], mapping["d2t"])
    summary = json.loads(wf.path("results/vocab/draft_vocab.json").read_text())
    assert summary["loss_tokens"] == sum(counts.values())
    assert summary["distinct_loss_tokens"] == len(counts)
    assert summary["padded_with_unseen_ids"] == max(0, 40 - len(counts))
    assert consumers_run.vocab_log.count("draft vocabulary") == 1


def test_the_workflow_exports_when_enabled(
    consumers_run: ConsumersRun, tiny_model_dir: Path
) -> None:
    wf = consumers_run.workflow
    assert "export_specforge" not in consumers_run.dry_run, "off by default"
    assert consumers_run.exports["specforge"]  # then turned on: built with the shards
    manifest_target = "results/hidden_states/A1/manifest.json"
    out = wf.path("results/specforge/A1")
    manifest = json.loads(wf.path(manifest_target).read_text())
    index = json.loads((out / "index.json").read_text())
    assert index["num_samples"] == manifest["num_samples"]
    assert index["attrs"]["aux_layer_ids"] == manifest["attrs"]["aux_layer_ids"]
    i = 0
    for entry in manifest["shards"]:
        with open_shard(wf.path(f"results/hidden_states/A1/{entry['file']}")) as shard:
            for j in range(shard.num_samples):
                rows = slice(int(shard.sample_offsets[j]), int(shard.sample_offsets[j + 1]))
                raw = torch.load(out / specforge_file_name(i), weights_only=True)
                assert index["samples"][i]["id"] == shard.sample_ids[j]
                assert raw["input_ids"].tolist() == shard.input_ids[rows].tolist()
                assert raw["loss_mask"].tolist() == shard.loss_mask[rows].tolist()
                assert raw["hidden_state"].dtype == torch.bfloat16
                # The shards hold the pre-norm state (the default); SpecForge gets the
                # target's own final norm of it, in the shards' dtype, bit for bit.
                assert shard.attrs["final_state"] == "pre_norm"
                pre = shard.last_hidden_states(rows, as_torch=True)
                last = load_final_norm(tiny_model_dir, dtype=pre.dtype)(pre)
                aux = shard.aux_hidden_states(rows, as_torch=True)
                assert torch.equal(raw["hidden_state"][0].view(torch.int16), last.view(torch.int16))
                assert torch.equal(
                    raw["aux_hidden_state"][0].view(torch.int16), aux.view(torch.int16)
                )
                i += 1
    assert i == manifest["num_samples"] > 0
    assert wf.path("logs/export_specforge/A1.log").read_text().count("conversations") == 1
    assert wf.plans_nothing()
    assert not list(wf.path("results/.work/specforge").iterdir())
