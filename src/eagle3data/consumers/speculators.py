"""Export validated shards as vLLM speculators' (0.9.0) offline EAGLE-3 training data.

speculators trains from one folder (its layout: :mod:`.speculators_format`). Every dataset
of the config is one training folder, its rows in a seeded order (speculators splits
train/val by row index).

The final state: speculators computes the teacher as ``lm_head(verifier_norm(last))`` with
its own ``LlamaRMSNorm`` carrying the checkpoint's ``model.norm.weight``, so it needs the
state the norm is applied to. Shards holding the pre-norm state (``final_state:
pre_norm``, the default) give it as is. Older shards hold the norm's output: for an
RMSNorm ``x * rsqrt(mean(x^2) + eps) * w`` with no zero weight, ``post / w`` is ``x`` up to
a positive scale per token, and the epsilon says which scale: ``x`` itself is restored and
exported from them (:meth:`.PlainRmsNorm.prenorm_of`). Either way speculators' teacher is
right only when the target's final norm is that formula: that is checked numerically on
the module of the target's own architecture carrying the checkpoint's weights, before any
work; for any other norm (Gemma's ``(1 + w)``, LayerNorm's mean and bias) speculators'
teacher is wrong whatever is exported, and the export says so in one line.

FP8 shards are dequantized by the loader. speculators' own FP8 layout (``hs_connectors``
``fp8`` backend) has one scale per token over all four layers; ours has one per 128
channels of each layer, so it cannot hold our values without a second rounding (and the
final state is divided by the norm weight anyway).

After writing, the export is read back and checked through speculators' own code
(:mod:`.speculators_check`). The folder is written under ``results/.work/`` and renamed
into place when complete and checked, so ``results/speculators/`` exists only whole.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..atomic import atomic_directory
from ..errors import ModelConfigError, SpeculatorsExportError
from ..hidden_states.final_state import (
    PRE_NORM,
    PlainRmsNorm,
    final_state_of,
    plain_rms_norm,
    refuse_zero_weights,
)
from ..loader import HiddenStateDataset
from ..model_config import hidden_size as config_hidden_size
from ..model_config import read_model_config
from .speculators_check import verify_speculators_export
from .speculators_format import (
    EXPORT_DTYPES,
    EXPORT_JSON,
    FORMAT,
    HIDDEN_STATES,
    SPECULATORS_NORM_KEY,
    Row,
    shard_manifest,
)

__all__ = [
    "SpeculatorsExportError",
    "export_speculators",
    "restorable_final_norm",
]

log = logging.getLogger(__name__)

_DEFAULT_TOTAL_SEQ_LEN = 8192


# ------------------------------------------------------------------ the final norm


def teacher_norm(model_path: str | Path, *, trust_remote_code: bool = False) -> PlainRmsNorm:
    """The target's final norm when it is the plain RMSNorm that speculators' teacher
    applies (:func:`~eagle3data.hidden_states.final_state.plain_rms_norm`); else a one-line
    refusal (its teacher would be wrong for this target whatever is exported)."""
    try:
        return plain_rms_norm(model_path, trust_remote_code=trust_remote_code)
    except ModelConfigError as exc:
        raise SpeculatorsExportError(
            f"{exc}; speculators' teacher applies that RMSNorm with {SPECULATORS_NORM_KEY} "
            f"to the final state, so it is wrong for this target whatever is exported; "
            f"not exported"
        ) from None


def restorable_final_norm(
    model_path: str | Path, *, trust_remote_code: bool = False
) -> PlainRmsNorm:
    """:func:`teacher_norm`, refused also when a weight is zero: the norm the export
    restores post-norm shards' pre-norm state with (it is lost in a zero-weight channel)."""
    norm = teacher_norm(model_path, trust_remote_code=trust_remote_code)
    try:
        refuse_zero_weights(norm.weight, model_path)
    except ModelConfigError as exc:
        raise SpeculatorsExportError(
            f"{exc}; speculators' teacher cannot be restored from the shards; not exported"
        ) from None
    return norm


# ------------------------------------------------------------------ writing


def _common_attrs(manifests: Sequence[Mapping[str, Any]], datasets: Sequence[str]) -> dict:
    """The shards' attributes every dataset must share to be one training folder."""
    keys = ("aux_layer_ids", "aux_hidden_states_indices", "hidden_size", "final_state", "model")
    present = [(d, m.get("attrs") or {}) for d, m in zip(datasets, manifests, strict=True)]
    present = [(d, a) for d, a in present if a]  # an empty dataset has no attrs
    if not present:
        return {}
    first_name, first = present[0]
    for name, attrs in present[1:]:
        for key in keys:
            if attrs.get(key) != first.get(key):
                raise SpeculatorsExportError(
                    f"{name} has {key}={attrs.get(key)!r} but {first_name} has "
                    f"{first.get(key)!r}: one speculators training folder needs one target "
                    f"and one set of layers"
                )
    final_state_of(first, first_name)
    return dict(first)


def row_order(counts: Sequence[int], seed: int) -> list[Row]:
    """Every conversation of every dataset, in a seeded order (a permutation of the
    datasets' conversations in config order)."""
    rows = [Row(d, i) for d, n in enumerate(counts) for i in range(n)]
    order = np.random.default_rng(seed).permutation(len(rows))
    return [rows[k] for k in order]


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def train_command(
    *,
    model_path: str,
    data_path: str,
    layer_ids: Sequence[int],
    draft_vocab_size: int,
    dtype: str,
    max_len: int,
) -> list[str]:
    """The ``speculators train`` command line for this export (CPU flags included: on a
    GPU drop ``--draft-attn-impl sdpa --loss-implementation eager`` for its faster ones)."""
    return [
        "speculators",
        "train",
        "--verifier-name-or-path",
        model_path,
        "--data-path",
        data_path,
        "--target-layer-ids",
        *(str(k) for k in layer_ids),
        "--draft-vocab-size",
        str(draft_vocab_size),
        "--d2t-path",
        f"{data_path}/d2t-{draft_vocab_size}.npy",
        "--t2d-path",
        f"{data_path}/t2d-{draft_vocab_size}.npy",
        "--hidden-states-dtype",
        dtype,
        # Its packing budget (default 8192): room for the longest conversation.
        *(["--total-seq-len", str(max_len)] if max_len > _DEFAULT_TOTAL_SEQ_LEN else []),
        "--on-missing",
        "raise",
        "--draft-attn-impl",
        "sdpa",
        "--loss-implementation",
        "eager",
    ]


def export_speculators(
    *,
    datasets: Sequence[str],
    shard_dirs: Sequence[str],
    model_path: str,
    draft_vocab: str,
    out_dir: str,
    work_dir: str,
    dtype: str = "bfloat16",
    seed: int = 0,
    responses: Sequence[str] | None = None,
    trust_remote_code: bool = False,
) -> None:
    """Write every conversation of ``shard_dirs`` (validated shards, one directory per
    dataset of ``datasets``) as one speculators training folder at ``out_dir``, check it
    through speculators' own code and rename it into place. ``responses`` (the datasets'
    response files) lets the self-check use the manifest's very positions."""
    from safetensors.torch import save

    if dtype not in EXPORT_DTYPES:
        raise SpeculatorsExportError(
            f"export.dtype {dtype!r}: speculators trains on bfloat16 or float32 hidden "
            f"states only (--hidden-states-dtype refuses float16)"
        )
    torch_dtype = EXPORT_DTYPES[dtype]
    manifests = [shard_manifest(d) for d in shard_dirs]
    attrs = _common_attrs(manifests, datasets)
    stored = final_state_of(attrs, shard_dirs[0] if shard_dirs else out_dir)
    if stored == PRE_NORM:
        teacher_norm(model_path, trust_remote_code=trust_remote_code)
        norm = None  # exported as is
    else:
        norm = restorable_final_norm(model_path, trust_remote_code=trust_remote_code)
    h = config_hidden_size(read_model_config(model_path))
    if attrs and int(attrs["hidden_size"]) != h:
        raise SpeculatorsExportError(
            f"the shards' hidden size is {attrs['hidden_size']} but {model_path} has {h}: "
            f"the states are not this model's"
        )
    mapping = torch.load(draft_vocab, weights_only=True)
    d2t, t2d = mapping["d2t"].to(torch.int64), mapping["t2d"].to(torch.bool)
    loaders = [HiddenStateDataset(d) for d in shard_dirs]
    rows = row_order([len(x) for x in loaders], seed)
    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    origin: list[dict[str, Any]] = []
    freq: dict[int, int] = {}
    with atomic_directory(Path(out_dir), Path(work_dir)) as tmp:
        (tmp / HIDDEN_STATES).mkdir()
        for i, row in enumerate(rows):
            item = loaders[row.dataset][row.index]
            input_ids = item["input_ids"].to(torch.int64)
            length = int(input_ids.numel())
            aux = item["aux_hidden_states"].reshape(length, 3, h)
            pre = item["last_hidden_states"]
            if norm is not None:
                pre = norm.prenorm_of(pre)
            states = torch.cat([aux.to(torch_dtype), pre.to(torch_dtype)[:, None]], dim=1)
            blob = save({"hidden_states": states.contiguous(), "token_ids": input_ids.clone()})
            _write_bytes(tmp / HIDDEN_STATES / f"hs_{i}.safetensors", blob)
            ids.append(input_ids.numpy())
            masks.append(item["loss_mask"].to(torch.int64).numpy())
            supervised = ids[-1][masks[-1] == 1]
            for token, count in zip(*np.unique(supervised, return_counts=True), strict=True):
                freq[int(token)] = freq.get(int(token), 0) + int(count)
            origin.append({"dataset": datasets[row.dataset], "id": item["id"], "tokens": length})
        for loader in loaders:
            loader.close()
        table = _rows_table(ids, masks)
        # A fingerprint from the content: save_to_disk writes it, and a random one
        # would make two runs' bytes differ.
        table._fingerprint = _fingerprint(origin, dtype, seed)
        table = table.with_format("torch")
        table.save_to_disk(str(tmp))
        n = int(d2t.numel())
        np.save(tmp / f"d2t-{n}.npy", d2t.numpy())
        np.save(tmp / f"t2d-{n}.npy", t2d.numpy())
        with open(tmp / "token_freq.pt", "wb") as fh:
            torch.save(dict(sorted(freq.items())), fh)
        layer_ids = list(attrs.get("aux_hidden_states_indices", []))
        max_len = max([int(a.size) for a in ids], default=1)
        command = train_command(
            model_path=model_path,
            data_path=out_dir,
            layer_ids=layer_ids,
            draft_vocab_size=n,
            dtype=dtype,
            max_len=max(max_len, int(attrs.get("max_seq_len", max_len))),
        )
        info = {
            "format": FORMAT,
            "datasets": list(datasets),
            "num_samples": len(rows),
            "num_tokens": int(sum(a.size for a in ids)),
            "dtype": dtype,
            "seed": seed,
            "target_layer_ids": layer_ids,
            "target_layer_ids_convention": "hidden_states_index (vLLM/speculators: the "
            "input of layer k, output_hidden_states[k]); aux_layer_ids (layer_output) "
            f"{attrs.get('aux_layer_ids')}",
            "final_state": "pre_norm: the shards' pre-norm state"
            if norm is None
            else "pre_norm: restored from the shards' post-norm state (divided by the final "
            "norm's weight, each token's scale from the norm's epsilon)",
            "draft_vocab_size": n,
            "train_command": shlex.join(command),
            "cpu_note": "on CPU speculators' Trainer moves the model to the accelerator "
            "index unconditionally: patch its device or train with an own loop",
            "attrs": attrs,
            "rows": origin,
        }
        checks = verify_speculators_export(
            tmp,
            datasets=datasets,
            shard_dirs=shard_dirs,
            model_path=model_path,
            dtype=dtype,
            rows=rows,
            responses=responses,
            trust_remote_code=trust_remote_code,
        )
        info["self_check"] = checks
        (tmp / EXPORT_JSON).write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
    log.info(
        "%d conversations of %s, %d tokens -> %s; train with: %s",
        len(rows),
        ", ".join(datasets),
        info["num_tokens"],
        out_dir,
        info["train_command"],
    )


def _rows_table(ids: Sequence[np.ndarray], masks: Sequence[np.ndarray]) -> Any:
    """The rows as an HF dataset, built from Arrow arrays (16 bytes a token, no Python
    int per token)."""
    import pyarrow as pa
    from datasets import Dataset, DatasetInfo, Features, List, Value
    from datasets.table import InMemoryTable

    lengths = np.array([a.size for a in ids], dtype=np.int64)
    if lengths.sum() >= 2**31:  # Arrow lists (what speculators' rows are) index with int32
        raise SpeculatorsExportError(
            f"{int(lengths.sum())} tokens do not fit one speculators training folder's Arrow "
            f"lists (2^31); export fewer datasets"
        )
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))

    def column(parts: Sequence[np.ndarray]) -> Any:
        values = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return pa.ListArray.from_arrays(offsets, pa.array(values.astype(np.int64)))

    features = Features(
        {
            "input_ids": List(Value("int64")),
            "loss_mask": List(Value("int64")),
            "seq_len": Value("int64"),
        }
    )
    arrays = {"input_ids": column(ids), "loss_mask": column(masks), "seq_len": pa.array(lengths)}
    table = pa.table(arrays, schema=features.arrow_schema)
    return Dataset(InMemoryTable(table), info=DatasetInfo(features=features))


def _fingerprint(origin: Sequence[Mapping[str, Any]], dtype: str, seed: int) -> str:
    import hashlib

    digest = hashlib.sha256(json.dumps([origin, dtype, seed], sort_keys=True).encode())
    return digest.hexdigest()[:16]
