"""The plan_shards checkpoint: cut a dataset's tokens into shards of bounded bytes.

Shards are cut in response order, so a raised budget appends conversations: the full
shards before them keep their rows. Each shard gets a spec, ``shard-NNNNN.json`` under
``results/.work/shards/{dataset}/``, holding everything its extraction reads besides
the model and the ``hidden_states`` settings (Snakemake tracks those); a spec is
rewritten only when its content changes, and it is what makes a shard job re-run, so a
budget change extracts only new or changed shards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import polars as pl

from ..atomic import atomic_open, write_json
from ..errors import DiskSpaceError
from ..layout import SHARD_GLOB, shard_name, shard_number
from ..model_config import hidden_size, read_model_config, resolve_dtype_name
from ..shards import bytes_per_token
from ..tokenization.table import read_rows
from ..units import human_bytes
from .settings import CaptureSettings

log = logging.getLogger(__name__)


def rows_digest(rows: pl.DataFrame) -> str:
    """What a shard's extraction reads from its rows, as one hash (ids, tokens, masks, and
    the images of rows that have any: another picture is other states)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update("\0".join(rows["id"].to_list()).encode())
    digest.update(rows["num_tokens"].cast(pl.Int64).to_numpy().tobytes())
    for column, dtype in (("input_ids", pl.Int64), ("loss_mask", pl.Int8)):
        digest.update(rows[column].explode().cast(dtype).to_numpy().tobytes())
    images = rows["images"].to_list() if "images" in rows.columns else []
    if any(images):  # text rows hash as they always did: no shard is redone for the column
        digest.update(json.dumps(images).encode())
    return digest.hexdigest()


def shard_spec(
    dataset: str, shard: int, start: int, end: int, rows: pl.DataFrame, tok_stats: Mapping[str, Any]
) -> dict[str, Any]:
    """The spec of shard ``shard``: rows [start, end) of the tokenized dataset."""
    return {
        "dataset": dataset,
        "shard": shard,
        "start": start,
        "end": end,
        "rows_digest": rows_digest(rows),
        **{key: tok_stats[key] for key in ("tokenizer_hash", "chat_template_hash", "max_seq_len")},
    }


def write_shard_specs(specs: list[dict[str, Any]], spec_dir: Path) -> int:
    """Write each spec whose content changed (an unchanged file keeps its mtime) and
    remove those of shards no longer planned. Returns how many were (re)written."""
    spec_dir.mkdir(parents=True, exist_ok=True)
    written = 0
    for spec in specs:
        path = spec_dir / f"shard-{shard_name(spec['shard'])}.json"
        text = json.dumps(spec, indent=2, sort_keys=True) + "\n"
        if not path.exists() or path.read_text() != text:
            with atomic_open(path) as fh:
                fh.write(text)
            written += 1
    remove_unplanned(spec_dir, "json", len(specs))
    return written


def remove_unplanned(directory: Path, suffix: str, planned: int) -> list[str]:
    """Remove ``shard-NNNNN.<suffix>`` files numbered beyond the plan (after a lowered
    budget): left there, they are stale data for anything that lists the directory."""
    stale = [
        path
        for path in sorted(directory.glob(f"shard-*.{suffix}"))
        if (number := shard_number(path, suffix)) is not None and number >= planned
    ]
    for path in stale:
        path.unlink()
    return [path.name for path in stale]


def cut_shards(lengths: list[int], max_tokens: int) -> list[dict[str, int]]:
    """Consecutive row ranges of at most ``max_tokens`` tokens (a longer row alone)."""
    shards: list[dict[str, int]] = []
    start = 0
    tokens = 0
    for i, n in enumerate(lengths):
        if i > start and tokens + n > max_tokens:
            shards.append({"start": start, "end": i, "tokens": tokens})
            start, tokens = i, 0
        tokens += n
    if start < len(lengths):
        shards.append({"start": start, "end": len(lengths), "tokens": tokens})
    return shards


def plan_shards(
    *,
    dataset: str,
    tokenized_path: str,
    tokenize_stats_path: str,
    model_path: str,
    capture: CaptureSettings,
    out_plan: str,
    spec_dir: str,
) -> None:
    model_config = read_model_config(model_path)
    dtype = resolve_dtype_name(capture.dtype, model_config)
    width = hidden_size(model_config)
    storage = capture.storage_dtype
    per_token = bytes_per_token(width, dtype, storage)
    rows = read_rows(tokenized_path)  # once: the slices below are views
    lengths = rows["num_tokens"].to_list()
    shards = cut_shards(lengths, max(1, capture.shard_bytes // per_token))
    total = sum(lengths)
    check_disk_space(dataset, Path(out_plan).parent, total * per_token)
    tok_stats = json.loads(Path(tokenize_stats_path).read_text())
    specs = [
        shard_spec(dataset, k, s["start"], s["end"], rows[s["start"] : s["end"]], tok_stats)
        for k, s in enumerate(shards)
    ]
    changed = write_shard_specs(specs, Path(spec_dir))
    removed = remove_unplanned(Path(out_plan).parent, "h5", len(shards))
    if removed:
        log.info("%s: removed %d shard(s) no longer planned: %s", dataset, len(removed), removed)
    log.info("%s: %d of %d shard(s) new or changed", dataset, changed, len(shards))
    write_json(
        out_plan,
        {
            "dataset": dataset,
            "hidden_dtype": dtype,
            "storage_dtype": storage or dtype,
            "hidden_size": width,
            "bytes_per_token": per_token,
            "tokens": total,
            "estimated_bytes": total * per_token,
            "shards": [{"shard": k, **s} for k, s in enumerate(shards)],
        },
    )
    log.info(
        "%s: %d conversations, %d tokens -> %d shard(s), about %.1f MB of hidden states",
        dataset,
        len(lengths),
        total,
        len(shards),
        total * per_token / 1e6,
    )


def check_disk_space(dataset: str, shard_dir: Path, needed: int) -> None:
    """Fail before any forward pass when the shards cannot fit.

    Shards already in the directory are about to be replaced, so their bytes
    count as available.
    """
    shard_dir.mkdir(parents=True, exist_ok=True)
    replaced = sum(p.stat().st_size for p in shard_dir.glob(SHARD_GLOB))
    free = shutil.disk_usage(shard_dir).free + replaced
    if needed > free:
        raise DiskSpaceError(
            f"{dataset}: the hidden states need about {human_bytes(needed)} but only "
            f"{human_bytes(free)} are free on {shard_dir}; free space, move results/ to a "
            "larger disk, or lower the token budget or hidden_states.max_seq_len"
        )
