"""How far a dataset's generation is, from its journal, fast enough for huge journals.

The status command and the dry-run preview both need, per dataset, the budget prefix
decided so far and an estimate of the rest. A journal of a million long responses is
tens of GB of JSON, so it is summarised once into a small table (id, tokens, time)
cached beside it and extended incrementally: the journal is append-only, and only its
complete lines are ever summarised (a torn tail that is later cut off never was). A
cache in another layout than :data:`SUMMARY_SCHEMA` (written by an older version) is
not used: the journal is summarised again from its start.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from ..atomic import atomic_path, write_json
from ..generation.budget import Selection, select_prefix_arrays
from ..generation.records import SUMMARY_SCHEMA, summarise_lines


def journal_summary(journal: Path, cache_dir: Path | None = None) -> pl.DataFrame:
    """One row per complete journal record (see :data:`SUMMARY_SCHEMA`), in journal order.

    With ``cache_dir`` the summary of what was read before is reused and only the
    appended bytes are parsed; a journal shorter than the cached offset (deleted and
    restarted) is summarised from scratch, and so is one whose cached table has other
    columns than :data:`SUMMARY_SCHEMA`. A cache that cannot be written is skipped.
    """
    if not journal.exists():
        return pl.DataFrame(schema=SUMMARY_SCHEMA)
    cached, offset = pl.DataFrame(schema=SUMMARY_SCHEMA), 0
    table = meta = None
    if cache_dir is not None:
        table = cache_dir / f"{journal.parent.name}-{journal.stem}.parquet"
        meta = table.with_suffix(".json")
        try:
            info = json.loads(meta.read_text())
            if info["journal"] == str(journal) and info["offset"] <= journal.stat().st_size:
                table_read = pl.read_parquet(table)
                if table_read.schema == pl.Schema(SUMMARY_SCHEMA):  # else: an older layout
                    cached, offset = table_read, int(info["offset"])
        except (OSError, ValueError, KeyError, pl.exceptions.PolarsError):
            pass  # no usable cache: read everything
    with open(journal, "rb") as fh:
        fh.seek(offset)
        data = fh.read()
    complete = data[: data.rfind(b"\n") + 1]
    if not complete:
        return cached
    summary = pl.concat([cached, summarise_lines(complete, str(journal), cached.height + 1)])
    if table is not None and meta is not None:
        try:
            with atomic_path(table) as tmp:
                summary.write_parquet(tmp)
            write_json(meta, {"journal": str(journal), "offset": offset + len(complete)})
        except OSError:
            pass  # read-only results: the summary is still right, just not cached
    return summary


@dataclass(frozen=True)
class DatasetProgress:
    """The budget prefix so far and an estimate of the whole, for one dataset."""

    selection: Selection
    prompts: int  # in the dataset's seeded order
    conversations: int  # in the prefix decided so far
    completion_tokens: int  # of those
    conversation_tokens: int  # their full lengths, capped at max_seq_len
    generated_tokens: int  # everything journaled, used or not
    failed: int
    expected_conversations: int  # when the prefix is decided: exact
    expected_tokens: int  # conversation tokens of the whole prefix
    expected_completion_tokens: int  # what the budget counts, of the whole prefix
    basis: str  # "decided", "extrapolated" or "nothing yet"
    records: pl.DataFrame  # the current prompts' outcomes (ok or failed; the first per id)
    # Everything the engine generated for the current prompts: ``records``, then the
    # abandoned records (the rows the generate job's records.parquet holds); what rates
    # and the throughput picture count.
    journal: pl.DataFrame
    # Conversations cancelled in flight (abandoned records): how many, what the engine
    # decoded for them (part of generated_tokens, so of the waste) and the part of that
    # no server reported (estimated).
    abandoned_requests: int
    abandoned_tokens: int
    abandoned_tokens_estimated: int


def dataset_progress(
    order: Sequence[str],
    prompt_hashes: Sequence[str],
    summary: pl.DataFrame,
    *,
    token_budget: int | None,
    max_samples: int | None,
    max_seq_len: int,
) -> DatasetProgress:
    """Select the budget prefix over ``summary`` like generation does, then extrapolate
    the undecided rest at the cost of the conversations finished so far.

    Like the driver's ``load_journal``: a prompt's outcome is its first ok or failed
    record of the current prompt text; abandoned records (cancelled in flight) decide
    nothing, wherever they are in the journal, and count only as generated tokens.
    """
    wanted = pl.DataFrame(
        {"id": list(order), "prompt_hash": list(prompt_hashes)},
        schema={"id": pl.String, "prompt_hash": pl.String},
    )
    current = summary.join(wanted, on=["id", "prompt_hash"], how="semi")
    abandoned = current.filter(pl.col("abandoned"))
    records = current.filter(~pl.col("abandoned")).unique("id", keep="first", maintain_order=True)
    journal = pl.concat([records, abandoned])
    capped = records.with_columns(pl.col("conversation_tokens").clip(upper_bound=max_seq_len))
    # One row per prompt position, with its record's outcome when there is one.
    by_position = wanted.select("id").join(capped, on="id", how="left", maintain_order="left")
    known = by_position["failed"].is_not_null().to_numpy()
    sel = select_prefix_arrays(
        known,
        by_position["failed"].fill_null(False).to_numpy(),
        by_position["completion_tokens"].fill_null(0).to_numpy(),
        token_budget=token_budget,
        max_samples=max_samples,
    )
    lengths = by_position["conversation_tokens"].fill_null(0).to_numpy()
    done = len(sel.selected)
    tokens = int(lengths[sel.selected].sum()) if done else 0
    ok = capped.filter(~pl.col("failed"))
    abandoned_tokens = int(abandoned["spent_tokens"].sum() or 0)
    generated = int(journal["spent_tokens"].sum() or 0)
    failed = int(records["failed"].sum() or 0)

    def result(convs: int, total: int, completion: int, basis: str) -> DatasetProgress:
        return DatasetProgress(
            sel,
            len(order),
            done,
            sel.tokens,
            tokens,
            generated,
            failed,
            convs,
            total,
            completion,
            basis,
            records,
            journal,
            abandoned.height,
            abandoned_tokens,
            int(abandoned["spent_estimated"].sum() or 0),
        )

    if sel.complete:
        return result(done, tokens, sel.tokens, "decided")
    if ok.height == 0:
        return result(done, tokens, sel.tokens, "nothing yet")
    per_conversation = float(ok["conversation_tokens"].mean())  # type: ignore[arg-type]
    completion = max(float(ok["completion_tokens"].mean()), 1.0)  # type: ignore[arg-type]
    more = float(len(order) - sel.frontier)
    if max_samples is not None:
        more = min(more, max_samples - done)
    end = sel.tokens + round(more * completion)
    if token_budget is not None and sel.tokens + more * completion >= token_budget:
        # The budget binds: the prefix is expected to fill it (rounding would miss it by one).
        more, end = max(token_budget - sel.tokens, 0) / completion, token_budget
    return result(done + round(more), tokens + round(more * per_conversation), end, "extrapolated")


def file_lines(path: Path) -> int:
    if not path.exists():
        return 0
    with open(path, "rb") as fh:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: fh.read(1 << 20), b""))
