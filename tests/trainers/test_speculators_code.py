"""vLLM speculators 0.9.0's own code over our speculators export of the real demo model.

The export is made from the session's workflow run (SmolLM2-135M, greedy, float32 states)
by the export function itself, into this test's directory: its self-check reads the folder
through speculators' ``ArrowDataset``, ``check_hidden_states`` and ``CollateFn`` and holds
the teacher speculators computes (its ``LlamaRMSNorm`` carrying the target's norm weight,
its weight loader, SmolLM2's tied head) to our manifest's agreement on the same positions.
Handing it the post-norm state as is collapses that teacher (0.98 -> ~0.3 on the demo).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.exported_run import DATASET, ExportedRun

pytest.importorskip("speculators", reason="the README's test command installs speculators")

from speculators.train.data import ArrowDataset, CollateFn

from eagle3data.consumers import speculators as spec
from eagle3data.consumers.speculators_check import verify_speculators_export
from eagle3data.consumers.speculators_format import EXPORT_JSON
from eagle3data.loader import HiddenStateDataset

pytestmark = pytest.mark.e2e


def _export(run: ExportedRun, out: Path) -> dict:
    shard_dir = str(run.path(f"results/hidden_states/{DATASET}"))
    spec.export_speculators(
        datasets=[DATASET],
        shard_dirs=[shard_dir],
        model_path=str(run.model_dir),
        draft_vocab=str(run.path("results/vocab/draft_vocab.pt")),
        out_dir=str(out),
        work_dir=str(out.parent / "work"),
        responses=[str(run.path(f"results/responses/{DATASET}.jsonl"))],
    )
    return json.loads((out / EXPORT_JSON).read_text())


def test_speculators_reads_the_export_and_its_teacher_agrees(
    exported_run: ExportedRun, tmp_path: Path
) -> None:
    out = tmp_path / "speculators"
    info = _export(exported_run, out)
    ours = exported_run.manifest["agreement"]
    got = info["self_check"]["agreement"][DATASET]
    # The very positions the validate job scored, and the teacher speculators computes.
    assert got["positions"] == ours["positions"] > 50
    assert got["shards_agreement_same_positions"] == got["manifest_agreement"] == ours["agreement"]
    assert got["speculators_teacher_agreement"] == pytest.approx(ours["agreement"], abs=0.02)
    data = ArrowDataset(max_len=4096, datapath=str(out), on_missing="raise")
    assert len(data) == exported_run.manifest["num_samples"]
    batch = CollateFn(4096, 576, num_target_layers=3)([data[i] for i in range(len(data))])
    assert batch["hidden_states"].shape[-1] == 3 * 576
    assert info["target_layer_ids"] == exported_run.manifest["attrs"]["aux_hidden_states_indices"]


def test_the_post_norm_state_handed_over_as_is_is_caught(
    exported_run: ExportedRun, tmp_path: Path
) -> None:
    out = tmp_path / "speculators"
    info = _export(exported_run, out)
    shards = HiddenStateDataset(
        exported_run.path(f"results/hidden_states/{DATASET}"),
        final_state="post_norm",
        model=exported_run.model_dir,
    )
    post = {shards[j]["id"]: shards[j]["last_hidden_states"] for j in range(len(shards))}
    for i, row in enumerate(info["rows"]):
        path = out / "hidden_states" / f"hs_{i}.safetensors"
        tensors = load_file(path)
        tensors["hidden_states"][:, 3] = post[row["id"]].to(torch.bfloat16)
        save_file(tensors, path)
    with pytest.raises(
        spec.SpeculatorsExportError, match=r"agrees with the next token at 0\.[0-4]"
    ):
        verify_speculators_export(
            out,
            datasets=[DATASET],
            shard_dirs=[str(exported_run.path(f"results/hidden_states/{DATASET}"))],
            model_path=str(exported_run.model_dir),
            responses=[str(exported_run.path(f"results/responses/{DATASET}.jsonl"))],
        )
