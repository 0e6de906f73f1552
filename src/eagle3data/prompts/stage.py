"""The prompts stage: stream one source, order it, write the prompts table and the skips.

The seeded order is a sort by ``order_key``; a source can be larger than memory, so
conversations are written in chunks to per-bucket spill files (the bucket is the order
key's first hex digit) and each bucket is sorted on its own: peak memory is a chunk or a
bucket, never the source. Small sources never spill.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..atomic import atomic_open, atomic_path, dumps_line
from ..errors import PromptFormatError
from .sources import Conversation, IngestStats, iter_conversations, order_key
from .table import ARROW_SCHEMA, numbered, prompt_rows

log = logging.getLogger(__name__)

CHUNK_ROWS = 20_000
BUCKETS = 16  # by the order key's first hex digit: a bucket is 1/16 of the source


class _OrderedWriter:
    """Collect conversations; write them in the seeded order, spilling when there are many."""

    def __init__(self, out: Path, shuffle_seed: int, chunk_rows: int | None = None) -> None:
        self.out = out
        self.seed = shuffle_seed
        self.chunk_rows = chunk_rows or CHUNK_ROWS
        self.pending: list[Conversation] = []
        self.spill_dir = out.parent / f".{out.name}.spill"
        shutil.rmtree(self.spill_dir, ignore_errors=True)  # a killed run's leftovers
        self.buckets: dict[str, pq.ParquetWriter] = {}

    def add(self, conversation: Conversation) -> None:
        self.pending.append(conversation)
        if len(self.pending) >= self.chunk_rows:
            self._spill()

    def _keyed(self) -> pa.Table:
        keys = [order_key(self.seed, c.id) for c in self.pending]
        rows = prompt_rows(self.pending).append_column("order_key", pa.array(keys, pa.string()))
        self.pending = []
        return rows

    def _spill(self) -> None:
        rows = self._keyed()
        bucket_of = pc.utf8_slice_codeunits(rows["order_key"], 0, 1)
        for bucket in pc.unique(bucket_of).to_pylist():
            part = rows.filter(pc.equal(bucket_of, bucket))
            if bucket not in self.buckets:
                self.spill_dir.mkdir(parents=True, exist_ok=True)
                path = self.spill_dir / f"{bucket}.parquet"
                self.buckets[bucket] = pq.ParquetWriter(path, part.schema)
            self.buckets[bucket].write_table(part)

    def finish(self) -> int:
        try:
            with atomic_path(self.out) as tmp:
                if not self.buckets:  # small source: sort in memory
                    ordered = numbered(self._keyed().sort_by("order_key"))
                    pq.write_table(ordered, tmp)
                    return ordered.num_rows
                self._spill()
                for writer in self.buckets.values():
                    writer.close()
                written = 0
                with pq.ParquetWriter(tmp, ARROW_SCHEMA) as out:
                    for bucket in sorted(self.buckets):
                        rows = pq.read_table(self.spill_dir / f"{bucket}.parquet")
                        out.write_table(numbered(rows.sort_by("order_key"), written))
                        written += rows.num_rows
                return written
        finally:
            shutil.rmtree(self.spill_dir, ignore_errors=True)


def prepare_prompts(
    *,
    dataset: str,
    source: str,
    fmt: str = "auto",
    on_invalid: str,
    shuffle_seed: int,
    out_prompts: str,
    out_skipped: str,
    split: str | None = None,
    fields: Mapping[str, Any] | None = None,
    min_valid_share: float = 0.5,
) -> None:
    stats = IngestStats()
    writer = _OrderedWriter(Path(out_prompts), shuffle_seed)
    skipped = 0
    with atomic_open(out_skipped) as skipped_file:
        items = iter_conversations(
            source,
            fmt,
            on_invalid=on_invalid,  # type: ignore[arg-type]
            split=split,
            fields=fields,
            stats=stats,
        )
        for item in items:
            if isinstance(item, Conversation):
                writer.add(item)
                continue
            skipped += 1
            skipped_file.write(dumps_line(item.as_row()))
            if skipped <= 20:
                where = item.file if item.line is None else f"{item.file}:{item.line}"
                record = "" if item.line is not None else f" record {item.record}"
                log.warning("%s: skipped %s%s: %s", dataset, where, record, item.reason)
        _check_readable(dataset, source, stats, min_valid_share)
        count = writer.finish()
    for warning in stats.warnings():
        log.warning("%s: %s", dataset, warning)
    log.info(
        "%s: %d conversations from %d records of %s (%d invalid, %d duplicates; see %s)",
        dataset,
        count,
        stats.records,
        source,
        stats.invalid,
        stats.duplicates,
        out_skipped,
    )


def _check_readable(dataset: str, source: str, stats: IngestStats, min_valid_share: float) -> None:
    """Skip mode must not pass a dataset it could not read."""
    if stats.records == 0:
        raise PromptFormatError(f"{source}: no records found (dataset {dataset})")
    if stats.valid_share >= min_valid_share:
        return
    common = ", ".join(f"{reason} ({n})" for reason, n in stats.reasons.most_common(3))
    raise PromptFormatError(
        f"{source}: only {stats.records - stats.invalid} of {stats.records} records are valid "
        f"({stats.valid_share:.0%}), below datasets.{dataset}.min_valid_share="
        f"{min_valid_share}; most common problems: {common} (the first skips are in the log)"
    )
