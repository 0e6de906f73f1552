"""``results/prompts/{dataset}.parquet``: one dataset's normalised prompts, in order.

One row per conversation, in the seeded order: ``index`` (position in that order),
``id``, ``prompt_hash`` (of what generation reads: the system and user turns),
``source_line`` and ``messages`` (``[{role, content}]``, source assistant turns kept
as references). Generation, the status command and the dry run read it back here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from ..atomic import atomic_path
from .sources import Conversation

MESSAGE = pl.Struct({"role": pl.String, "content": pl.String})
SCHEMA = {
    "index": pl.UInt32,
    "id": pl.String,
    "prompt_hash": pl.String,
    "source_line": pl.UInt32,
    "messages": pl.List(MESSAGE),
}


def write_prompts(path: str | Path, ordered: Sequence[Conversation]) -> None:
    """Write conversations already in the seeded order, atomically."""
    df = pl.DataFrame(
        {
            "index": list(range(len(ordered))),
            "id": [c.id for c in ordered],
            "prompt_hash": [c.prompt_hash for c in ordered],
            "source_line": [c.line for c in ordered],
            "messages": [c.messages for c in ordered],
        },
        schema=SCHEMA,
    )
    with atomic_path(path) as tmp:
        df.write_parquet(tmp)


def iter_prompts(path: str | Path) -> Iterator[dict[str, Any]]:
    """Rows (``id``, ``prompt_hash``, ``messages``, ...) in the seeded order."""
    yield from pl.read_parquet(path).sort("index").iter_rows(named=True)


def prompt_order(path: str | Path) -> tuple[list[str], list[str]]:
    """Ids and prompt hashes in the seeded order."""
    df = pl.read_parquet(path, columns=["index", "id", "prompt_hash"]).sort("index")
    return df["id"].to_list(), df["prompt_hash"].to_list()
