"""``results/tokenized/{dataset}.parquet``: one dataset's conversations as model input.

One row per training sample that has something to learn, in response order: ``index``
(the response's position in the seeded order), ``id`` (the sample id, see
:func:`sample_id_of`), ``turn`` (null for a whole conversation, else the message index of
the first assistant turn the sample trains), ``input_ids`` (int32), ``loss_mask`` (uint8,
1 on what the target produced), ``num_tokens`` and ``truncated`` (cut at
``max_seq_len``) and ``images`` (the sha256 of each image whose tokens the sample holds,
in order: the dataset's image table has them; empty for text). Shard planning,
extraction and the draft vocabulary read it back here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from ..atomic import atomic_path

SCHEMA = {
    "index": pl.UInt32,
    "id": pl.String,
    "turn": pl.UInt32,
    "input_ids": pl.List(pl.Int32),
    "loss_mask": pl.List(pl.UInt8),
    "num_tokens": pl.UInt32,
    "truncated": pl.Boolean,
    "images": pl.List(pl.String),
}
# What a hidden-state shard is made of.
SHARD_COLUMNS = ["id", "num_tokens", "input_ids", "loss_mask"]


def sample_id_of(response_id: str, turn: int | None, samples: int) -> str:
    """A sample's id: the response's own when the response makes one sample, else
    ``{response_id}#{turn}``, ``turn`` the message index of the first assistant turn the
    sample trains (it trains that turn and the turns after it up to the next sample's;
    per-turn samples, one turn each, are the case where every turn starts one)."""
    return response_id if samples == 1 else f"{response_id}#{turn}"


def write_tokenized(path: str | Path, rows: Mapping[str, Sequence[Any]]) -> pl.DataFrame:
    """Write columns named as in :data:`SCHEMA`, atomically; return the frame written."""
    df = pl.DataFrame(dict(rows), schema=SCHEMA)
    with atomic_path(path) as tmp:
        df.write_parquet(tmp)
    return df


def read_rows(path: str | Path, columns: Sequence[str] = SHARD_COLUMNS) -> pl.DataFrame:
    """The shard columns (and ``images``, in a table that has them)."""
    return pl.read_parquet(path, columns=_with_images(path, columns))


def _with_images(path: str | Path, columns: Sequence[str]) -> list[str]:
    """``columns``, plus ``images`` where the table has it (not in one written before)."""
    names = pl.read_parquet_schema(path)
    return [*columns, "images"] if "images" in names and "images" not in columns else list(columns)


def read_row_range(path: str | Path, start: int, end: int) -> pl.DataFrame:
    """Rows [start, end) of the shard columns, reading only the row groups they are in."""
    lazy = pl.scan_parquet(path).select(_with_images(path, SHARD_COLUMNS))
    return lazy.slice(start, end - start).collect()
