"""The journal record: one prompt whose generation finished, or failed for good.

One definition for everyone who reads or writes records: the driver builds them
(:func:`ok_record`, :func:`failed_record`) and reads them back on resume, the budget
counts :func:`counted_tokens`, accounting and progress count :func:`spent_tokens`, and
the status command, the dry run and the report read the same fields from journals of
any size with polars (:func:`summarise_lines`, :data:`SUMMARY_SCHEMA`).

On disk (one JSON line per record, keys sorted)::

    ok:     {id, prompt_hash, status: "ok", messages, finish_reason,
             usage: {prompt_tokens, completion_tokens}, turns: [Turn, ...], finished_at,
             tools (only for conversations with tools)}
    failed: {id, prompt_hash, status: "failed", error, completion_tokens_spent, finished_at,
             kind (only for a known kind: "over_context")}
    abandoned: {id, prompt_hash, status: "abandoned", completion_tokens_spent, spent_source,
             finished_at}

An abandoned record is not an outcome: the conversation was in flight when the run cancelled
it (its prefix was decided without it, or the run was stopped), and the prompt stays
undecided (a later dispatch may generate it again). It records what the engine decoded for
it, all waste: the turns it finished and what the cancelled turn had decoded, as the server
said (``spent_source: "server"``, SGLang's answer to an abort) or estimated from how long it
ran (``"estimate"``). Readers of outcomes skip it (:func:`is_outcome`); :func:`spent_tokens`
counts it.

A :class:`Turn` keeps the token ids the engine saw and produced (``token_ids``, stored
compactly: :mod:`eagle3data.turn_ids`) where it returned them.

``finished_at`` (unix seconds) is when the record was journaled; journals written before
it existed lack it. ``messages`` is the regenerated conversation: the source's system,
user and tool turns (``name`` as given; ``tool_call_id`` the id of the regenerated call
a result answers, see ``driver._answering``) and the regenerated assistant turns
(``reasoning_content`` and ``tool_calls`` when the engine returned them); one
:class:`Turn` per assistant message, in order.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping
from typing import Any, Literal, NotRequired, TypedDict

import polars as pl

from .. import __version__
from ..atomic import dumps_line
from ..errors import JournalCorruptError
from ..turn_ids import TurnTokenIds

# Every kind of record a journal holds (the docstring above); a reader refuses others.
RECORD_STATUSES = ("ok", "failed", "abandoned")


def unknown_status(where: str, line: int, status: object) -> JournalCorruptError:
    """The one-line error for a record of a kind this build does not know (builds from
    before "abandoned" read such a record as an outcome and crashed deep inside; from here
    on a kind this build does not know is named, by the driver and the summaries alike)."""
    return JournalCorruptError(
        f"{where}:{line}: a record of status {status!r}, which this build "
        f"(eagle3data {__version__}) does not know (it reads "
        f"{', '.join(RECORD_STATUSES)}): a newer eagle3data wrote it; run that one, "
        "or move the journal away to generate again"
    )


class Turn(TypedDict):
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    usage_source: NotRequired[str]  # "tokenizer": the server reported no usage
    # The ids the engine saw and produced; None: the engine returned none; absent in
    # records written before ids were kept.
    token_ids: NotRequired[TurnTokenIds | None]


class Usage(TypedDict):
    prompt_tokens: int  # summed over the turns
    completion_tokens: int


class OkRecord(TypedDict):
    id: str
    prompt_hash: str
    status: Literal["ok"]
    messages: list[dict[str, Any]]
    finish_reason: str  # the last turn's
    usage: Usage
    turns: list[Turn]
    finished_at: NotRequired[float]
    tools: NotRequired[list[dict[str, Any]]]  # the OpenAI tool specs offered, if any


class FailedRecord(TypedDict):
    id: str
    prompt_hash: str
    status: Literal["failed"]
    error: str
    # By the turns before the one that failed, and by that one if the server generated an
    # answer that was not kept (cut by the context): generated, never in the output.
    completion_tokens_spent: int
    finished_at: NotRequired[float]
    kind: NotRequired[str]  # "over_context": the conversation does not fit the context


class AbandonedRecord(TypedDict):
    id: str
    prompt_hash: str
    status: Literal["abandoned"]
    completion_tokens_spent: int  # decoded for the conversation, none of it kept
    spent_source: Literal["server", "estimate"]
    finished_at: NotRequired[float]


JournalRecord = OkRecord | FailedRecord


def ok_record(
    prompt_id: str,
    prompt_hash: str,
    messages: list[dict[str, Any]],
    turns: list[Turn],
    *,
    tools: list[dict[str, Any]] | None = None,
) -> OkRecord:
    record: OkRecord = {
        "id": prompt_id,
        "prompt_hash": prompt_hash,
        "status": "ok",
        "messages": messages,
        "finish_reason": turns[-1]["finish_reason"],
        "usage": {
            "prompt_tokens": sum(t["prompt_tokens"] for t in turns),
            "completion_tokens": sum(t["completion_tokens"] for t in turns),
        },
        "turns": turns,
    }
    if tools is not None:  # absent otherwise: records without tools are unchanged
        record["tools"] = tools
    return record


def failed_record(
    prompt_id: str, prompt_hash: str, error: str, spent: int, kind: str | None = None
) -> FailedRecord:
    record: FailedRecord = {
        "id": prompt_id,
        "prompt_hash": prompt_hash,
        "status": "failed",
        "error": error,
        "completion_tokens_spent": spent,
    }
    if kind is not None:  # absent otherwise: other failures are recorded as before
        record["kind"] = kind
    return record


def abandoned_record(
    prompt_id: str, prompt_hash: str, spent: int, *, estimated: bool
) -> AbandonedRecord:
    return {
        "id": prompt_id,
        "prompt_hash": prompt_hash,
        "status": "abandoned",
        "completion_tokens_spent": spent,
        "spent_source": "estimate" if estimated else "server",
    }


def is_failed(record: Mapping[str, Any]) -> bool:
    return bool(record["status"] == "failed")


def is_outcome(record: Mapping[str, Any]) -> bool:
    """Whether the record decides its prompt (ok or failed), unlike an abandoned one."""
    return record.get("status") != "abandoned"


def counted_tokens(record: Mapping[str, Any]) -> int:
    """What the budget counts: the completion tokens of a record in the output (0 if failed)."""
    return int(record["usage"]["completion_tokens"]) if record["status"] == "ok" else 0


def spent_tokens(record: Mapping[str, Any]) -> int:
    """Completion tokens the engine generated for the record, used or not."""
    if record["status"] in ("failed", "abandoned"):
        return int(record["completion_tokens_spent"])
    return int(record["usage"]["completion_tokens"])


# --- the same fields, read with polars from journals of any size ---------------------

# The record fields the summary reads (everything else in a line is skipped unparsed).
RECORD_SCHEMA = {
    "id": pl.String,
    "prompt_hash": pl.String,
    "status": pl.String,
    "usage": pl.Struct({"completion_tokens": pl.Int64}),
    "turns": pl.List(pl.Struct({"prompt_tokens": pl.Int64, "completion_tokens": pl.Int64})),
    "completion_tokens_spent": pl.Int64,
    "spent_source": pl.String,
    "finished_at": pl.Float64,
}
SUMMARY_SCHEMA = {
    "id": pl.String,
    "prompt_hash": pl.String,
    "failed": pl.Boolean,
    "completion_tokens": pl.Int64,  # counted_tokens
    "spent_tokens": pl.Int64,  # spent_tokens
    "conversation_tokens": pl.Int64,  # last turn's prompt + completion: the full length
    "finished_at": pl.Float64,  # null in journals written before it was recorded
    "abandoned": pl.Boolean,  # an abandoned record: waste, never an outcome
    "spent_estimated": pl.Int64,  # of spent_tokens, the part no server reported
}


def summarise_lines(chunk: bytes, where: str = "journal", first_line: int = 1) -> pl.DataFrame:
    """One :data:`SUMMARY_SCHEMA` row per complete JSON line of ``chunk`` (lines
    ``first_line``.. of the journal ``where``); a record of a status this build does not
    know is refused, naming its line (it is no outcome and no waste this build can count)."""
    if not chunk.strip():
        return pl.DataFrame(schema=SUMMARY_SCHEMA)
    raw = pl.read_ndjson(io.BytesIO(chunk), schema=RECORD_SCHEMA)
    known = pl.col("status").is_in(RECORD_STATUSES).fill_null(False)
    odd = raw.with_row_index("line").filter(~known).head(1)
    if odd.height:
        raise unknown_status(where, first_line + int(odd["line"][0]), odd["status"][0])
    failed = pl.col("status") == "failed"
    abandoned = pl.col("status") == "abandoned"
    completion = pl.col("usage").struct.field("completion_tokens")
    spent = pl.col("completion_tokens_spent").fill_null(0)
    last = pl.col("turns").list.last()
    return raw.select(
        "id",
        "prompt_hash",
        failed.alias("failed"),
        pl.when(failed | abandoned).then(0).otherwise(completion).alias("completion_tokens"),
        pl.when(failed | abandoned).then(spent).otherwise(completion).alias("spent_tokens"),
        (last.struct.field("prompt_tokens") + last.struct.field("completion_tokens"))
        .fill_null(0)
        .alias("conversation_tokens"),
        "finished_at",
        abandoned.alias("abandoned"),
        pl.when(abandoned & (pl.col("spent_source") == "estimate"))
        .then(spent)
        .otherwise(0)
        .alias("spent_estimated"),
    ).cast(SUMMARY_SCHEMA)  # type: ignore[arg-type]


def summarise(records: Iterable[Mapping[str, Any]]) -> pl.DataFrame:
    """:func:`summarise_lines` of records in memory (read the same way as on disk); only
    the fields it reads are serialised, not the conversations' text."""
    fields = [{k: r[k] for k in RECORD_SCHEMA if k in r} for r in records]
    return summarise_lines("".join(dumps_line(f) for f in fields).encode())
