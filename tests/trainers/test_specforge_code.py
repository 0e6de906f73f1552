"""SpecForge 0.2.0's own code reads our export and trains on it as the workflow writes it.

Its offline reader, feature store, ``eagle3_offline_v1`` normalizer and collator take every
file; its ``TargetHead`` (the target's lm_head, cast to bf16) over our ``hidden_state``
predicts the next supervised token as often as our manifest's agreement says; our
``draft_vocab.pt`` passes its consistency check. The forward was float32 (the CPU demo's):
the export is bf16, because ``TargetHead`` cannot take anything else.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.exported_run import DATASET, ExportedRun
from support.target_models import specforge_view

pytest.importorskip("specforge", reason="the README's test command installs specforge==0.2.0")

from specforge.algorithms.eagle3.data import (
    NORMALIZER_ID,
    build_offline_collator,
    build_offline_normalizer,
    build_offline_reader,
)
from specforge.core.compact_teacher import validate_vocab_mapping_consistency
from specforge.modeling.target.target_head import TargetHead
from specforge.runtime.data_plane.feature_store import LocalFeatureStore

pytestmark = pytest.mark.e2e

MAX_LEN = 2048


def _samples(run: ExportedRun) -> list[dict[str, torch.Tensor]]:
    """Every exported conversation, as SpecForge's offline data plane hands it to training."""
    reader = build_offline_reader(
        str(run.path("results/specforge")), run_id="t", ttt_length=7, max_len=MAX_LEN
    )
    store = LocalFeatureStore()
    normalize = build_offline_normalizer(MAX_LEN)
    samples = []
    for ref in reader.read():
        tensors, handle = store.get(ref)
        samples.append(normalize(tensors))
        store.release(handle)
    return samples


def test_specforge_reads_the_export_and_its_teacher_agrees(
    exported_run: ExportedRun, tmp_path: Path
) -> None:
    assert NORMALIZER_ID == "eagle3_offline_v1"
    index = json.loads(run_index(exported_run).read_text())
    samples = _samples(exported_run)
    assert len(samples) == index["num_samples"] == exported_run.manifest["num_samples"] > 0

    batch = build_offline_collator()(samples)
    lengths = [s["input_ids"].shape[1] for s in samples]
    assert batch["input_ids"].shape == (len(samples), max(lengths))
    assert batch["hidden_state"].shape[-1] == 3 * batch["target"].shape[-1]
    assert batch["hidden_state"].dtype == batch["target"].dtype == torch.bfloat16

    head = TargetHead.from_pretrained(
        str(specforge_view(exported_run.model_dir, tmp_path / "model")),
        lm_head_key="model.embed_tokens.weight",
    )
    agree = positions = 0
    with torch.no_grad():
        for s in samples:
            predicted = head(s["target"][0]).argmax(-1)  # bf16 head over bf16 states
            ids, mask = s["input_ids"][0], s["loss_mask"][0]
            # Positions whose next token the target produced: the teacher's label there.
            produced = mask[1:].bool()
            agree += int((predicted[:-1] == ids[1:])[produced].sum())
            positions += int(produced.sum())
    ours = exported_run.manifest["agreement"]
    # SpecForge's normalizer zeroes each conversation's last loss-mask entry, so the final
    # end-of-turn is never its label (6 of 158 positions here); ours scores it.
    assert ours["positions"] - len(samples) <= positions <= ours["positions"]
    assert positions > 50
    # bf16 head and states against our float32 check, over nearly the same positions
    # (ours leaves out the few the template wrote): measured 0.96-0.98 for both.
    assert agree / positions == pytest.approx(ours["agreement"], abs=0.03)
    assert agree / positions > ours["control_agreement"] + 0.5


def test_specforge_cannot_take_a_float32_export(exported_run: ExportedRun, tmp_path: Path) -> None:
    """Why the export is bf16 by default: SpecForge's head is bf16 whatever it reads."""
    head = TargetHead.from_pretrained(
        str(specforge_view(exported_run.model_dir, tmp_path / "model")),
        lm_head_key="model.embed_tokens.weight",
    )
    [first] = _samples(exported_run)[:1]
    with pytest.raises(RuntimeError, match="dtype"):
        head(first["target"].float())


def test_specforge_accepts_the_draft_vocabulary(exported_run: ExportedRun) -> None:
    mapping = torch.load(exported_run.path("results/vocab/draft_vocab.pt"), weights_only=True)
    validate_vocab_mapping_consistency(mapping["t2d"], mapping["d2t"])
    summary = json.loads(exported_run.path("results/vocab/draft_vocab.json").read_text())
    assert mapping["d2t"].numel() == summary["size"] == 256
    # A broken mapping is refused by the same check.
    broken = mapping["t2d"].clone()
    broken[int(torch.nonzero(~broken)[0])] = True
    with pytest.raises(ValueError, match="t2d selects"):
        validate_vocab_mapping_consistency(broken, mapping["d2t"])


def run_index(run: ExportedRun) -> Path:
    return run.path(f"results/specforge/{DATASET}/index.json")
