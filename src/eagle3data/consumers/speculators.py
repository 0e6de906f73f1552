"""Export validated shards as vLLM speculators' (0.9.0) offline EAGLE-3 training data.

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

The final state: speculators computes the teacher as ``lm_head(verifier_norm(last))`` with
its own ``LlamaRMSNorm`` carrying the checkpoint's ``model.norm.weight``, so it needs the
state the norm is applied to. Shards holding the pre-norm state (``final_state:
pre_norm``, the default) give it as is. Older shards hold the norm's output: for an
RMSNorm ``x * rsqrt(mean(x^2) + eps) * w`` with no zero weight, ``post / w`` is ``x`` up to
a positive scale per token, and RMSNorm is scale-invariant: ``norm(post / w) == post``
(within ~eps), which is what is exported from them. Either way speculators' teacher is
right only when the target's final norm is that formula: that is checked numerically on
the module of the target's own architecture carrying the checkpoint's weights, before any
work; for any other norm (Gemma's ``(1 + w)``, LayerNorm's mean and bias) speculators'
teacher is wrong whatever is exported, and the export says so in one line.

FP8 shards are dequantized by the loader. speculators' own FP8 layout (``hs_connectors``
``fp8`` backend) has one scale per token over all four layers; ours has one per 128
channels of each layer, so it cannot hold our values without a second rounding (and the
final state is divided by the norm weight anyway).

After writing, the export is read back through speculators' own ``ArrowDataset``,
``check_hidden_states`` and ``CollateFn``, and checked: the aux states equal the shards'
(rounded once to the export dtype), speculators' norm of the exported final state equals
the shards' post-norm state, and the teacher computed as speculators computes it (its norm
class, its weight loader) agrees with the next token as the manifest's agreement says, on
the same positions. The folder is written under ``results/.work/`` and renamed into place
when complete and checked, so ``results/speculators/`` exists only whole.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..atomic import atomic_directory
from ..errors import ModelConfigError, SpeculatorsExportError
from ..hidden_states import agreement
from ..hidden_states.final_state import (
    POST_NORM,
    PRE_NORM,
    final_state_of,
    plain_rms_norm_weight,
    prenorm_from_postnorm,
    refuse_zero_weights,
)
from ..loader import HiddenStateDataset
from ..model_config import hidden_size as config_hidden_size
from ..model_config import read_model_config, rms_norm_eps

__all__ = [
    "EXPORT_JSON",
    "SpeculatorsExportError",
    "export_speculators",
    "final_norm_weight",
    "verify_speculators_export",
]

log = logging.getLogger(__name__)

EXPORT_JSON = "export.json"
HIDDEN_STATES = "hidden_states"
FORMAT = "speculators-0.9-offline"
# speculators trains in bf16 or float32 (--hidden-states-dtype; it refuses float16).
EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# Agreement of speculators' teacher vs the manifest's, on the same positions: the export
# dtype's rounding flips a few near-ties, a wrong norm convention costs ~0.6.
AGREEMENT_TOLERANCE = 0.02
# speculators' norm of the exported final state vs the shards' post-norm state, relative to
# the state's RMS per token: the export dtype's rounding, twice (bf16: 2^-8 each).
FINAL_STATE_TOLERANCE = {"bfloat16": 0.01, "float32": 1e-4}
# FP8 shards: the norm re-normalizes their rounding noise (3 mantissa bits), ~1% of the RMS.
FP8_FINAL_STATE_TOLERANCE = 0.05
# Draft architecture of the command line (speculators' default for eagle3): its
# verifier_norm is this architecture's norm class.
DRAFT_ARCH = "llama"
_DEFAULT_TOTAL_SEQ_LEN = 8192
# speculators' checkpoint key of the final norm (speculators/model.py).
_SPECULATORS_NORM_KEY = "model.norm.weight"


# ------------------------------------------------------------------ the final norm


def teacher_norm_weight(model_path: str | Path, *, trust_remote_code: bool = False) -> torch.Tensor:
    """The target's final-norm weight (float32 [H]) when that norm is the plain RMSNorm
    that speculators' teacher applies
    (:func:`~eagle3data.hidden_states.final_state.plain_rms_norm_weight`); else a one-line
    refusal (its teacher would be wrong for this target whatever is exported)."""
    try:
        return plain_rms_norm_weight(model_path, trust_remote_code=trust_remote_code)
    except ModelConfigError as exc:
        raise SpeculatorsExportError(
            f"{exc}; speculators' teacher applies that RMSNorm with {_SPECULATORS_NORM_KEY} "
            f"to the final state, so it is wrong for this target whatever is exported; "
            f"not exported"
        ) from None


def final_norm_weight(model_path: str | Path, *, trust_remote_code: bool = False) -> torch.Tensor:
    """:func:`teacher_norm_weight`, refused also when a weight is zero: what the export
    divides post-norm shards by (the pre-norm state is lost in a zero-weight channel)."""
    weight = teacher_norm_weight(model_path, trust_remote_code=trust_remote_code)
    try:
        refuse_zero_weights(weight, model_path)
    except ModelConfigError as exc:
        raise SpeculatorsExportError(
            f"{exc}; speculators' teacher cannot be restored from the shards; not exported"
        ) from None
    return weight


# ------------------------------------------------------------------ writing


@dataclass(frozen=True)
class _Row:
    dataset: int  # position in the datasets list
    index: int  # conversation number within the dataset


def _manifest(shard_dir: str) -> dict[str, Any]:
    return json.loads((Path(shard_dir) / "manifest.json").read_text(encoding="utf-8"))


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


def row_order(counts: Sequence[int], seed: int) -> list[_Row]:
    """Every conversation of every dataset, in a seeded order (a permutation of the
    datasets' conversations in config order)."""
    rows = [_Row(d, i) for d, n in enumerate(counts) for i in range(n)]
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
    manifests = [_manifest(d) for d in shard_dirs]
    attrs = _common_attrs(manifests, datasets)
    stored = final_state_of(attrs, shard_dirs[0] if shard_dirs else out_dir)
    if stored == PRE_NORM:
        teacher_norm_weight(model_path, trust_remote_code=trust_remote_code)
        weight = None  # exported as is
    else:
        weight = final_norm_weight(model_path, trust_remote_code=trust_remote_code)
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
            if weight is not None:
                pre = prenorm_from_postnorm(pre, weight)  # RMSNorm: post / w ∝ pre
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
            if weight is None
            else "pre_norm: the shards' post-norm state divided by the final norm's weight "
            "(RMSNorm is scale-invariant)",
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


# ------------------------------------------------------------------ the self-check


class _Rows:
    """One shard's conversations as read back from the export, in the shape
    :func:`agreement.shard_agreement` reads a shard (the same positions are sampled)."""

    def __init__(self, path: str, samples: Sequence[Mapping[str, Any]], states: str, h: int):
        self.path = path
        self.hidden_size = h
        self.sample_ids = [s["id"] for s in samples]
        self.input_ids = np.concatenate([s["input_ids"] for s in samples])
        self.loss_mask = np.concatenate([s["loss_mask"] for s in samples])
        lengths = [len(s["input_ids"]) for s in samples]
        self.sample_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self._states = torch.cat([s[states] for s in samples])

    def last_hidden_states(self, as_torch: bool = True) -> torch.Tensor:
        return self._states


def _turns(responses: Sequence[str] | None, n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{} for _ in range(n)]
    for k, path in enumerate(responses or []):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    record = json.loads(line)
                    out[k][record["id"]] = agreement.turn_records(record)
    return out


def verify_speculators_export(
    export_dir: str | Path,
    *,
    datasets: Sequence[str],
    shard_dirs: Sequence[str],
    model_path: str,
    dtype: str = "bfloat16",
    rows: Sequence[_Row] | None = None,
    responses: Sequence[str] | None = None,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Read the export back through speculators' own code and check it against the shards
    (see the module docstring); raise :class:`SpeculatorsExportError` with one line on the
    first problem, else return the numbers. ``rows``: the export's row order (default: from
    its ``export.json``)."""
    try:
        from hs_connectors import FileTransfer  # noqa: F401  (speculators' data deps)
        from speculators.data_generation.offline import check_hidden_states
        from speculators.models.eagle3.model_definitions import model_classes
        from speculators.train.data import ArrowDataset, CollateFn
        from speculators.train.recovery import SampleUnavailable
        from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
        from speculators.utils.loading import load_model_layers
    except ImportError as exc:
        raise SpeculatorsExportError(
            f"the speculators export checks itself with speculators' own code, which does "
            f"not import ({exc}); install speculators==0.9.0 "
            f"(docs/how-to/training.md, 'speculators export')"
        ) from None

    export_dir = Path(export_dir)
    if rows is None:
        info = json.loads((export_dir / EXPORT_JSON).read_text(encoding="utf-8"))
        position = {(r["dataset"], r["id"]): k for k, r in enumerate(info["rows"])}
    torch_dtype = EXPORT_DTYPES[dtype]
    raw_config = read_model_config(model_path)
    h = config_hidden_size(raw_config)
    weights = load_model_layers(
        ["embed_tokens.weight", "lm_head.weight", _SPECULATORS_NORM_KEY], model_path
    )
    head = weights.get("lm_head.weight", weights["embed_tokens.weight"])
    norm = model_classes[DRAFT_ARCH].norm_class(h, eps=rms_norm_eps(raw_config))
    norm.load_state_dict({"weight": weights[_SPECULATORS_NORM_KEY].float()})
    data = ArrowDataset(
        max_len=1 << 30,
        datapath=str(export_dir),
        on_missing="raise",
        hidden_states_dtype=torch_dtype,
    )
    # Compared as post-norm: what speculators' teacher must give back.
    loaders = [
        HiddenStateDataset(
            d, final_state=POST_NORM, model=model_path, trust_remote_code=trust_remote_code
        )
        for d in shard_dirs
    ]
    if rows is not None:
        position = {(r.dataset, r.index): k for k, r in enumerate(rows)}
    if len(data) != sum(len(x) for x in loaders):
        raise SpeculatorsExportError(
            f"{export_dir}: speculators reads {len(data)} rows, the shards hold "
            f"{sum(len(x) for x in loaders)} conversations"
        )
    # Token frequencies reproduce the draft vocabulary as speculators would build it.
    n = next(export_dir.glob("d2t-*.npy")).name[4:-4]
    d2t = torch.from_numpy(np.load(export_dir / f"d2t-{n}.npy"))
    t2d = torch.from_numpy(np.load(export_dir / f"t2d-{n}.npy"))
    freq = torch.load(export_dir / "token_freq.pt", weights_only=True)
    if freq:
        want_d2t, want_t2d = build_vocab_mappings_from_distribution(freq, int(n), t2d.numel())
        if not (torch.equal(want_d2t, d2t) and torch.equal(want_t2d, t2d)):
            raise SpeculatorsExportError(
                f"{export_dir}: speculators' vocabulary builder over token_freq.pt does not "
                f"give d2t-{n}.npy/t2d-{n}.npy: the draft vocabulary is not this data's"
            )
    our_head = agreement.load_head(model_path)
    end_of_turn = agreement.end_of_turn_ids(model_path)
    turns = _turns(responses, len(shard_dirs))
    worst_final = 0.0
    results: dict[str, Any] = {}
    manifests = [_manifest(d) for d in shard_dirs]
    for d, (name, loader) in enumerate(zip(datasets, loaders, strict=True)):
        manifest = manifests[d]
        section = manifest.get("agreement") or {}
        count = (section.get("settings") or {}).get("positions_per_shard", 2048)
        count = None if count == "all" else int(count)
        spec_total, ours_total = agreement.AgreementStats(), agreement.AgreementStats()
        start = 0
        for k, shard in enumerate(loader.shards):
            samples = []
            for j in range(start, start + shard.num_samples):
                key = (d, j) if rows is not None else (name, loader[j]["id"])
                r = position[key]
                ours = loader[j]
                got = data[r]
                if isinstance(got, SampleUnavailable):
                    raise SpeculatorsExportError(
                        f"{export_dir}: speculators' dataset drops row {r} ({name} "
                        f"{ours['id']}): {got.reason}"
                    )
                raw = data.transfer.get_cached(r)
                try:
                    check_hidden_states(raw, ours["input_ids"].tolist())
                except ValueError as exc:
                    raise SpeculatorsExportError(
                        f"{export_dir}: row {r} ({name} {ours['id']}) fails speculators' "
                        f"check_hidden_states: {str(exc)[:200]}"
                    ) from None
                length = int(ours["input_ids"].numel())
                # Its collate takes the row (one row: a buffer of the row's length).
                CollateFn(max(length, 1), h, num_target_layers=3, dtype=torch_dtype)([got])
                if (
                    raw["hidden_states"].shape != (length, 4, h)
                    or raw["hidden_states"].dtype != torch_dtype
                ):
                    raise SpeculatorsExportError(
                        f"{export_dir}: hs_{r}.safetensors holds {raw['hidden_states'].dtype} "
                        f"{list(raw['hidden_states'].shape)}, not {dtype} [{length}, 4, {h}]"
                    )
                if not torch.equal(got["loss_mask"], ours["loss_mask"]):
                    raise SpeculatorsExportError(
                        f"{export_dir}: row {r} ({name} {ours['id']}): loss_mask differs from "
                        f"the shards'"
                    )
                want_aux = ours["aux_hidden_states"].to(torch_dtype)
                if not torch.equal(got["hidden_states"], want_aux):
                    layers = [
                        i
                        for i in range(3)
                        if not torch.equal(
                            got["hidden_states"][:, i * h : (i + 1) * h],
                            want_aux[:, i * h : (i + 1) * h],
                        )
                    ]
                    raise SpeculatorsExportError(
                        f"{export_dir}: row {r} ({name} {ours['id']}): aux layer(s) {layers} "
                        f"of speculators' hidden_states differ from the shards' (recorded "
                        f"order {manifest.get('attrs', {}).get('aux_hidden_states_indices')})"
                    )
                post = ours["last_hidden_states"].float()
                with torch.no_grad():
                    teacher = norm(got["verifier_last_hidden_states"].float())
                # Per token: RMS of the difference over the RMS of the state.
                rel = (teacher - post).pow(2).mean(-1).sqrt() / post.pow(2).mean(-1).sqrt()
                worst = float(rel.nan_to_num(0.0).max()) if length else 0.0
                worst_final = max(worst_final, worst)
                samples.append(
                    {
                        "id": ours["id"],
                        "input_ids": ours["input_ids"].numpy(),
                        "loss_mask": ours["loss_mask"].numpy(),
                        "teacher": teacher,
                        "post": post,
                    }
                )
            start += shard.num_samples
            if not samples:
                continue
            for states, total in (("teacher", "spec"), ("post", "ours")):
                stats = agreement.shard_agreement(
                    _Rows(str(shard.path), samples, states, h),
                    head if states == "teacher" else our_head,
                    end_of_turn,
                    count,
                    seed=k,
                    turns=turns[d],
                )
                if total == "spec":
                    spec_total = spec_total.combine(stats)
                else:
                    ours_total = ours_total.combine(stats)
        loader.close()
        spec, ours_summary = spec_total.summary(), ours_total.summary()
        reference = section.get("agreement", ours_summary["agreement"])
        results[name] = {
            "positions": spec["positions"],
            "speculators_teacher_agreement": spec["agreement"],
            "manifest_agreement": section.get("agreement"),
            "shards_agreement_same_positions": ours_summary["agreement"],
        }
        if spec["positions"] and abs(spec["agreement"] - reference) > AGREEMENT_TOLERANCE:
            raise SpeculatorsExportError(
                f"{name}: the teacher speculators computes from the export "
                f"(lm_head(verifier_norm(last))) agrees with the next token at "
                f"{spec['agreement']:.4f}, the manifest says {reference:.4f} over the same "
                f"{spec['positions']} positions: the final state is not what speculators expects"
            )
    tolerance = FINAL_STATE_TOLERANCE[dtype]
    if any((m.get("attrs") or {}).get("storage_dtype") == "float8_e4m3fn" for m in manifests):
        tolerance = max(tolerance, FP8_FINAL_STATE_TOLERANCE)
    if worst_final > tolerance:
        raise SpeculatorsExportError(
            f"{export_dir}: speculators' verifier norm of the exported final state differs "
            f"from the shards' post-norm state by {worst_final:.3g} of its RMS (tolerance "
            f"{tolerance}): the final state is not the pre-norm one"
        )
    return {
        "read_by": "speculators.train.data.ArrowDataset, CollateFn, check_hidden_states",
        "final_state_max_rel_error": worst_final,
        "final_state_tolerance": tolerance,
        "agreement": results,
    }
