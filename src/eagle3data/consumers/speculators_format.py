"""The speculators training folder's format: what vLLM speculators (0.9.0) reads of it.

speculators trains from one folder (``speculators train --data-path``)::

    {out}/                       an HF ``datasets`` folder (``save_to_disk``, torch format)
        input_ids   [L] int64    one row per conversation; row i's states are hs_i
        loss_mask   [L] int64 (0/1)
        seq_len     int64
    {out}/hidden_states/hs_{i}.safetensors
        hidden_states  [L, 4, H]  export dtype: the three aux layers (in the recorded
                                  layer order), then the final layer's output BEFORE the
                                  final norm
        token_ids      [L] int64  equal to row i's input_ids (else speculators drops it)
    {out}/d2t-{N}.npy, t2d-{N}.npy   the draft vocabulary (results/vocab/draft_vocab.pt)
    {out}/token_freq.pt          {token id: count} over the supervised tokens
    {out}/export.json            layer ids, the ``speculators train`` command, the rows'
                                 origin and the self-check's numbers (ignored by speculators)

(``speculators/train/data.py::ArrowDataset``, ``hs_connectors`` ``FileTransfer``,
``speculators/train/cli.py::parse_vocab_mappings``). Every dataset of the config is one
training folder, its rows in a seeded order (speculators splits train/val by row index).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "EXPORT_DTYPES",
    "EXPORT_JSON",
    "FORMAT",
    "HIDDEN_STATES",
    "SPECULATORS_NORM_KEY",
    "Row",
    "shard_manifest",
]

EXPORT_JSON = "export.json"
HIDDEN_STATES = "hidden_states"
FORMAT = "speculators-0.9-offline"
# speculators trains in bf16 or float32 (--hidden-states-dtype; it refuses float16).
EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# speculators' checkpoint key of the final norm (speculators/model.py).
SPECULATORS_NORM_KEY = "model.norm.weight"


@dataclass(frozen=True)
class Row:
    """One row of the folder: which conversation it holds."""

    dataset: int  # position in the datasets list
    index: int  # conversation number within the dataset


def shard_manifest(shard_dir: str) -> dict[str, Any]:
    """A validated shard directory's ``manifest.json`` (the rows' attributes, agreement)."""
    return json.loads((Path(shard_dir) / "manifest.json").read_text(encoding="utf-8"))
