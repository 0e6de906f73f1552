"""``results/prompts/{dataset}.parquet``: one dataset's normalised prompts, in order.

One row per conversation, in the seeded order: ``index`` (position in that order),
``id``, ``prompt_hash`` (of what generation reads: the system, user and tool turns
and the tools), where it came from (``source_file``, ``source_line`` for JSON Lines
and JSON text, ``source_record``), ``messages`` (``[{role, content, parts, tool_calls,
tool_call_id, name}]``, source assistant turns kept as references; ``tool_calls`` as
a JSON string, unset keys null) and ``tools`` (a JSON string, or null). A message with
images has its list of parts as a JSON string in ``parts`` and their text joined in
``content`` (:func:`eagle3data.images.content_text`), so a reader of the text sees it;
``parts`` is null for text content. The images are in the image table beside it.

:func:`iter_prompts` gives rows back in the normalised form of :mod:`.shapes`:
unset message keys absent, ``tool_calls``, ``tools`` and parts decoded. Generation, the
status command and the dry run read the table here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from ..atomic import atomic_path
from ..images import content_text
from .sources import Conversation

_OPTIONAL_MESSAGE_KEYS = ("tool_calls", "tool_call_id", "name")


def _dumps(value: Any) -> str | None:
    return None if value is None else json.dumps(value, ensure_ascii=False)


def _stored_message(message: dict[str, Any]) -> dict[str, Any]:
    content = message["content"]
    return {
        "role": message["role"],
        "content": content_text(content),
        "parts": None if isinstance(content, str) else _dumps(content),
        "tool_calls": _dumps(message.get("tool_calls")),
        "tool_call_id": message.get("tool_call_id"),
        "name": message.get("name"),
    }


def _normalised_message(stored: dict[str, Any]) -> dict[str, Any]:
    parts = stored.get("parts")
    content = stored["content"] if parts is None else json.loads(parts)
    message = {"role": stored["role"], "content": content}
    for key in _OPTIONAL_MESSAGE_KEYS:
        value = stored.get(key)
        if value is not None:
            message[key] = json.loads(value) if key == "tool_calls" else value
    return message


ARROW_MESSAGE = pa.struct(
    [(name, pa.string()) for name in ("role", "content", "parts", *_OPTIONAL_MESSAGE_KEYS)]
)
ARROW_SCHEMA = pa.schema(
    [
        ("index", pa.uint32()),
        ("id", pa.string()),
        ("prompt_hash", pa.string()),
        ("source_file", pa.string()),
        ("source_line", pa.uint32()),
        ("source_record", pa.uint32()),
        ("messages", pa.list_(ARROW_MESSAGE)),
        ("tools", pa.string()),
    ]
)


def prompt_rows(conversations: Sequence[Conversation]) -> pa.Table:
    """Conversations as table rows without ``index`` (the stage numbers them once ordered).

    Built with pyarrow: it converts nested lists of dicts in C, about ten times faster
    than polars' row-by-row conversion of a list-of-struct column.
    """
    columns = {
        "id": [c.id for c in conversations],
        "prompt_hash": [c.prompt_hash for c in conversations],
        "source_file": [c.file for c in conversations],
        "source_line": [c.line for c in conversations],
        "source_record": [c.record for c in conversations],
        "messages": [[_stored_message(m) for m in c.messages] for c in conversations],
        "tools": [_dumps(c.tools) for c in conversations],
    }
    return pa.table(columns, schema=ARROW_SCHEMA.remove(0))


def numbered(ordered: pa.Table, start: int = 0) -> pa.Table:
    """Rows already in the seeded order with their ``index``, in the table's column order."""
    index = pa.array(range(start, start + ordered.num_rows), pa.uint32())
    return ordered.select(ARROW_SCHEMA.names[1:]).add_column(0, "index", index)


def write_prompts(path: str | Path, ordered: Sequence[Conversation]) -> None:
    """Write conversations already in the seeded order, atomically."""
    with atomic_path(path) as tmp:
        pq.write_table(numbered(prompt_rows(ordered)), tmp)


def iter_prompts(path: str | Path) -> Iterator[dict[str, Any]]:
    """Rows (``id``, ``prompt_hash``, ``messages``, ``tools``, ...) in the seeded order."""
    for row in pl.read_parquet(path).sort("index").iter_rows(named=True):
        row["messages"] = [_normalised_message(m) for m in row["messages"]]
        row["tools"] = None if row.get("tools") is None else json.loads(row["tools"])
        yield row


def prompt_order(path: str | Path) -> tuple[list[str], list[str]]:
    """Ids and prompt hashes in the seeded order."""
    df = pl.read_parquet(path, columns=["index", "id", "prompt_hash"]).sort("index")
    return df["id"].to_list(), df["prompt_hash"].to_list()
