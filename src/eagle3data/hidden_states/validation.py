"""The validate job: check every shard of a dataset against the plan and the tokenized
data, and write ``manifest.json`` (what training code trusts) only if all is well."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import polars as pl

from ..atomic import write_json
from ..errors import ValidationError
from ..shards import open_shard, validate_shard
from ..tokenization.table import sample_id_of

log = logging.getLogger(__name__)

CHECKS = [
    "format name and version",
    "dataset shapes and dtypes against attributes",
    "offsets start at 0, strictly increase, end at the token count",
    "all hidden states finite",
    "float8 storage: one finite, positive float32 scale per token per block",
    "every sample has at least one loss token",
    "ids unique and equal to the planned slice of the tokenized data",
    "tokenized samples are the responses in order, each trained (whole or per assistant "
    "turn) or recorded as dropped",
]


def sample_id_errors(
    rows: pl.DataFrame, response_ids: list[str], dropped: list[dict[str, Any]]
) -> list[str]:
    """Check that the tokenized samples are the responses, in order, each response
    either trained (as one sample or one per assistant turn) or recorded as dropped."""
    errors: list[str] = []
    ids = rows["id"].to_list()
    if len(set(ids)) != len(ids):
        errors.append("sample ids are not unique")
    indices = rows["index"].to_list()
    if indices != sorted(indices):
        errors.append("samples are not in response order")
    for index, sample_id, turn in rows.iter_rows():
        if not 0 <= index < len(response_ids):
            errors.append(f"sample {sample_id!r} names response index {index}, which is absent")
            break
        # Whole conversation, or one of its per-turn samples (tokenization.table).
        one, per_turn = (sample_id_of(response_ids[index], turn, n) for n in (1, 2))
        if sample_id not in (one, per_turn):
            errors.append(f"sample {sample_id!r} does not belong to response {index}")
            break
    covered = set(indices) | {d.get("index") for d in dropped}
    missing = [i for i in range(len(response_ids)) if i not in covered]
    if missing:
        errors.append(
            f"{len(missing)} response(s) neither tokenized nor recorded as dropped "
            f"(first: {response_ids[missing[0]]!r})"
        )
    return errors


def validate(
    *,
    dataset: str,
    responses_path: str,
    tokenized_path: str,
    tokenize_stats_path: str,
    plan_path: str,
    shard_paths: list[str],
    out_manifest: str,
) -> None:
    plan = json.loads(Path(plan_path).read_text())
    tok_stats = json.loads(Path(tokenize_stats_path).read_text())
    rows = pl.read_parquet(tokenized_path, columns=["index", "id", "turn"])
    tokenized = rows["id"].to_list()
    with open(responses_path, encoding="utf-8") as fh:
        response_ids = [json.loads(line)["id"] for line in fh]
    errors = sample_id_errors(rows, response_ids, tok_stats["dropped"])
    errors = [f"{tokenized_path}: {e} (responses: {responses_path})" for e in errors]
    if len(shard_paths) != len(plan["shards"]):
        errors.append(f"expected {len(plan['shards'])} shards, got {len(shard_paths)}")
    shards = []
    for entry, path in zip(plan["shards"], shard_paths, strict=False):
        expected = tokenized[entry["start"] : entry["end"]]
        check = validate_shard(path, expected_ids=expected, hidden_size=plan["hidden_size"])
        errors.extend(check.errors)
        shards.append(
            {
                "file": Path(path).name,
                "samples": check.num_samples,
                "tokens": check.num_tokens,
                "sha256": check.sha256,
            }
        )
    if errors:
        raise ValidationError(
            f"{dataset}: {len(errors)} problem(s) found:\n" + "\n".join(f"  - {e}" for e in errors)
        )
    attrs: dict[str, Any] = {}
    if shard_paths:  # a dataset can be empty (e.g. token_budget 0): no shards, still valid
        with open_shard(shard_paths[0]) as first:
            skip = ("shard", "num_samples", "num_tokens")
            attrs = {k: v for k, v in first.attrs.items() if k not in skip}
    manifest = {
        "dataset": dataset,
        "num_shards": len(shards),
        "num_samples": sum(s["samples"] for s in shards),
        "num_tokens": sum(s["tokens"] for s in shards),
        "num_loss_tokens": tok_stats["loss_tokens"],
        "bytes": sum(Path(p).stat().st_size for p in shard_paths),
        "shards": shards,
        "checks": CHECKS,
        "attrs": _jsonable(attrs),
    }
    write_json(out_manifest, manifest)
    log.info(
        "%s: %d shards, %d samples, %d tokens validated",
        dataset,
        manifest["num_shards"],
        manifest["num_samples"],
        manifest["num_tokens"],
    )


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return obj
