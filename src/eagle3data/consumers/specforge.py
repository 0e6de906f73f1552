"""Export validated shards as SpecForge offline EAGLE-3 feature files.

SpecForge (sgl-project/SpecForge) trains offline from one ``torch.save`` file per
conversation, written by its ``scripts/prepare_hidden_states.py``:

    {out}/rows_{g}-{g + 2000}/data_{i}.ckpt     g = 2000 * (i // 2000)

    input_ids         [L]        int64
    loss_mask         [L]        int64 (0/1)
    hidden_state      [1, L, H]  export dtype  final layer after the final norm
    aux_hidden_state  [1, L, 3H] export dtype  the three aux layers, concatenated

(storage contract ``specforge_hidden_states_v1`` in
``specforge/algorithms/eagle3/providers.py``; file naming in
``prepare_hidden_states.py::_get_file_path``). Its reader
(``specforge/runtime/data_plane/offline_reader.py``) walks the directory for
``.ckpt``/``.ckpt.gz`` files in sorted order and loads each with
``torch.load(path, weights_only=False, mmap=True)``; training then uses
``aux_hidden_state`` as the draft input and ``hidden_state`` as the target (projected
by the target's lm_head, so it must be the post-norm state: shards holding the pre-norm
state go through the target's own final norm, in the shards' forward dtype, exactly as
the target applied it). Unlike SpecForge's own capture, no padding is stored: L is
the conversation's length. "Export dtype" is ``export.dtype``, bf16 by default: SpecForge's
``TargetHead`` casts the target's head to bf16, so its training fails on float32 states
("expected m1 and m2 to have the same dtype"), which is what a CPU forward gives. Shards
stored as float8 (``hidden_states.storage_dtype``) are dequantized by the loader first,
since SpecForge reads plain tensors.

``index.json`` (ignored by SpecForge's reader: not a ``.ckpt``) maps every file to its
conversation id and records the shards' provenance attributes.

The directory is written under ``results/.work/`` and renamed into place when
complete, so ``results/specforge/{dataset}/`` exists only whole.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from ..atomic import atomic_directory
from ..errors import ConfigError
from ..hidden_states.final_state import POST_NORM, final_state_of
from ..loader import HiddenStateDataset

__all__ = [
    "EXPORT_DTYPES",
    "FILE_GROUP_SIZE",
    "export_specforge",
    "specforge_file_name",
    "specforge_record",
]

log = logging.getLogger(__name__)

# SpecForge's default --file-group-size: files per rows_* subdirectory.
FILE_GROUP_SIZE = 2000
STORAGE_FORMAT = "specforge_hidden_states_v1"
INDEX = "index.json"
# export.dtype's names (config/schema.yaml) as torch dtypes.
EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def specforge_file_name(index: int, group_size: int = FILE_GROUP_SIZE) -> str:
    """Path of conversation ``index`` relative to the export directory, as SpecForge names it."""
    group = (index // group_size) * group_size
    return f"rows_{group}-{group + group_size}/data_{index}.ckpt"


def specforge_record(
    item: dict[str, Any], dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """One loader item in SpecForge's key names, shapes and dtypes."""
    # Fresh storages (clone when the dtype already matches): torch.save writes a view's
    # whole storage, not just the view.
    return {
        "input_ids": item["input_ids"].to(torch.int64),
        "loss_mask": item["loss_mask"].to(torch.int64),
        "hidden_state": item["last_hidden_states"].unsqueeze(0).to(dtype, copy=True),
        "aux_hidden_state": item["aux_hidden_states"].unsqueeze(0).to(dtype, copy=True),
    }


def export_specforge(
    *,
    dataset: str,
    shard_dir: str,
    out_dir: str,
    work_dir: str,
    model_path: str | None = None,
    group_size: int = FILE_GROUP_SIZE,
    dtype: str = "bfloat16",
    trust_remote_code: bool = False,
) -> None:
    """Write every conversation of ``shard_dir`` (validated shards) as SpecForge files,
    hidden states in ``dtype`` (a name of :data:`EXPORT_DTYPES`); ``model_path``, the
    target, is needed for shards that hold the pre-norm final state."""
    manifest = json.loads((Path(shard_dir) / "manifest.json").read_text(encoding="utf-8"))
    if manifest.get("num_image_tokens"):
        raise ConfigError(
            f"{dataset}: its samples hold images, and SpecForge does not train drafts of "
            "image-text targets (its docs: VLM training is not supported); set "
            "export.specforge: false and train from export.speculators"
        )
    torch_dtype = EXPORT_DTYPES[dtype]
    data = HiddenStateDataset(
        shard_dir,
        final_state=POST_NORM,
        model=model_path,
        trust_remote_code=trust_remote_code,
    )
    samples = []
    tokens = 0
    with atomic_directory(Path(out_dir), Path(work_dir)) as tmp:
        for i in range(len(data)):
            item = data[i]
            name = specforge_file_name(i, group_size)
            path = tmp / name
            path.parent.mkdir(exist_ok=True)
            with open(path, "wb") as fh:
                torch.save(specforge_record(item, torch_dtype), fh)
                fh.flush()
                os.fsync(fh.fileno())
            samples.append({"file": name, "id": item["id"], "tokens": len(item["input_ids"])})
            tokens += len(item["input_ids"])
        data.close()
        index = {
            "format": STORAGE_FORMAT,
            "dataset": dataset,
            "num_samples": len(samples),
            "num_tokens": tokens,
            "file_group_size": group_size,
            "dtype": dtype,
            "keys": {
                "input_ids": "[L] int64",
                "loss_mask": "[L] int64",
                "hidden_state": "[1, L, H] final layer after the final norm",
                "aux_hidden_state": "[1, L, 3H] aux layers (see attrs.aux_layer_ids)",
            },
            "final_state": (
                "post_norm: the shards' post-norm state"
                if final_state_of(manifest.get("attrs") or {}) == POST_NORM
                else "post_norm: the target's own final norm applied to the shards' pre-norm state"
            ),
            "attrs": manifest.get("attrs", {}),
            "samples": samples,
        }
        (tmp / INDEX).write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")
    log.info("%s: %d conversations, %d tokens -> %s", dataset, len(samples), tokens, out_dir)
