"""Independent restatements of what our outputs must agree with: SpecForge's offline
reader and its vocabulary check, and the draft-vocabulary rule in plain Python."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import torch


# What SpecForge's offline EAGLE-3 path does with a directory, reproduced from
# specforge/runtime/data_plane/{offline_reader,feature_store}.py and
# specforge/algorithms/eagle3/data.py::normalize_offline_sample.
def specforge_list(path: Path) -> list[str]:
    files = []
    for root, _dirs, names in os.walk(path):
        files += [os.path.join(root, n) for n in names if n.endswith((".ckpt", ".ckpt.gz"))]
    return sorted(files)


def specforge_normalize(raw: dict, max_len: int) -> dict:
    hidden_state = raw["aux_hidden_state"].squeeze(0)[:max_len].unsqueeze(0)
    target = raw["hidden_state"].squeeze(0)[:max_len].unsqueeze(0)
    input_ids = raw["input_ids"][:max_len].unsqueeze(0)
    loss_mask = raw["loss_mask"][:max_len].clone().unsqueeze(0)
    loss_mask[0, -1] = 0
    return {
        "attention_mask": torch.ones_like(loss_mask, dtype=torch.long),
        "loss_mask": loss_mask,
        "target": target,
        "hidden_state": hidden_state,
        "input_ids": input_ids,
    }


def reference_ids(counts: Counter[int], size: int, target_vocab: int) -> list[int]:
    """The documented rule in plain Python: top ``size`` by count then id, lowest unseen fill."""
    top = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    fill = [t for t in range(target_vocab) if t not in counts][: size - len(top)]
    return sorted(top + fill)


def check_specforge_consistency(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """specforge/core/compact_teacher.py::validate_vocab_mapping_consistency, restated."""
    selected = torch.nonzero(t2d.bool(), as_tuple=False).flatten()
    assert selected.numel() == d2t.numel()
    assert torch.equal(selected, d2t + torch.arange(d2t.numel()))
