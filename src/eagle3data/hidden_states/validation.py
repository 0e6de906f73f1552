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

log = logging.getLogger(__name__)

CHECKS = [
    "format name and version",
    "dataset shapes and dtypes against attributes",
    "offsets start at 0, strictly increase, end at the token count",
    "all hidden states finite",
    "every sample has at least one loss token",
    "ids unique and equal to the planned slice of the tokenized data",
    "tokenized ids equal the response ids minus recorded drops",
]


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
    tokenized = pl.read_parquet(tokenized_path, columns=["id"])["id"].to_list()
    with open(responses_path, encoding="utf-8") as fh:
        response_ids = [json.loads(line)["id"] for line in fh]
    dropped = {d["id"] for d in tok_stats["dropped"]}
    errors: list[str] = []
    if [i for i in response_ids if i not in dropped] != tokenized:
        errors.append(
            f"{tokenized_path}: ids differ from {responses_path} minus the "
            f"{len(dropped)} conversations dropped at tokenization"
        )
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
