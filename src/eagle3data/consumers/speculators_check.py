"""The speculators export's self-check: the folder read back through speculators' own code.

After writing, the export is read back through speculators' own ``ArrowDataset``,
``check_hidden_states`` and ``CollateFn``, and checked: the aux states equal the shards'
(rounded once to the export dtype), speculators' norm of the exported final state equals
the shards' post-norm state, and the teacher computed as speculators computes it (its norm
class, its weight loader) agrees with the next token as the manifest's agreement says, on
the same positions.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import SpeculatorsExportError
from ..hidden_states import agreement
from ..hidden_states.final_state import POST_NORM
from ..loader import HiddenStateDataset
from ..model_config import hidden_size as config_hidden_size
from ..model_config import read_model_config, rms_norm_eps
from .speculators_format import (
    EXPORT_DTYPES,
    EXPORT_JSON,
    SPECULATORS_NORM_KEY,
    Row,
    shard_manifest,
)

__all__ = [
    "AGREEMENT_TOLERANCE",
    "DRAFT_ARCH",
    "FINAL_STATE_TOLERANCE",
    "FP8_FINAL_STATE_TOLERANCE",
    "verify_speculators_export",
]

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
    rows: Sequence[Row] | None = None,
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
        ["embed_tokens.weight", "lm_head.weight", SPECULATORS_NORM_KEY], model_path
    )
    head = weights.get("lm_head.weight", weights["embed_tokens.weight"])
    norm = model_classes[DRAFT_ARCH].norm_class(h, eps=rms_norm_eps(raw_config))
    norm.load_state_dict({"weight": weights[SPECULATORS_NORM_KEY].float()})
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
    manifests = [shard_manifest(d) for d in shard_dirs]
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
