"""The prompts stage: stream one source, order it, write the prompts table, the skips and
the image table (the images of the conversations kept, written as they are read).

The seeded order is a sort by ``order_key``; a source can be larger than memory, so
conversations are written in chunks to per-bucket spill files (a bucket is a range of
order keys, sized from the source's bytes) and each bucket is sorted on its own: peak
memory is a chunk or a bucket, never the source. Small sources never spill.
"""

from __future__ import annotations

import logging
import shutil
from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..atomic import atomic_open, atomic_path, dumps_line
from ..errors import PromptFormatError
from ..images import ImageTableWriter
from .source_files import source_files
from .sources import Conversation, IngestStats, iter_conversations, order_key
from .table import ARROW_SCHEMA, numbered, prompt_rows

log = logging.getLogger(__name__)

CHUNK_ROWS = 20_000
BUCKET_SOURCE_BYTES = 32 << 20  # about this much source per bucket ...
MIN_BUCKET_BITS, MAX_BUCKET_BITS = 4, 8  # ... in 16 to 256 buckets (open files while spilling)


def bucket_bits(source_bytes: int) -> int:
    """log2 of the bucket count: enough buckets that each holds ~32 MB of the source."""
    buckets = max(1, -(-source_bytes // BUCKET_SOURCE_BYTES))
    return min(MAX_BUCKET_BITS, max(MIN_BUCKET_BITS, (buckets - 1).bit_length()))


class _OrderedWriter:
    """Collect conversations; write them in the seeded order, spilling when there are many."""

    def __init__(self, out: Path, shuffle_seed: int, source_bytes: int = 0) -> None:
        self.out = out
        self.seed = shuffle_seed
        self.chunk_rows = CHUNK_ROWS
        self.bits = bucket_bits(source_bytes)
        self.pending: list[Conversation] = []
        self.spill_dir = out.parent / f".{out.name}.spill"
        shutil.rmtree(self.spill_dir, ignore_errors=True)  # a killed run's leftovers
        self.buckets: dict[int, pq.ParquetWriter] = {}

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
        rows = self._keyed().sort_by("order_key")
        keys = rows["order_key"].to_pylist()
        start = 0
        while start < len(keys):
            # Buckets are ranges of the 12-bit key prefix; a sorted chunk splits at them.
            bucket = int(keys[start][:3], 16) >> (12 - self.bits)
            limit = (bucket + 1) << (12 - self.bits)
            end = len(keys) if limit >= 4096 else bisect_left(keys, f"{limit:03x}", lo=start)
            if bucket not in self.buckets:
                self.spill_dir.mkdir(parents=True, exist_ok=True)
                path = self.spill_dir / f"{bucket:04d}.parquet"
                self.buckets[bucket] = pq.ParquetWriter(path, rows.schema)
            self.buckets[bucket].write_table(rows.slice(start, end - start))
            start = end

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
                        rows = pq.read_table(self.spill_dir / f"{bucket:04d}.parquet")
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
    out_images: str,
    split: str | None = None,
    fields: Mapping[str, Any] | None = None,
    min_valid_share: float = 0.5,
) -> None:
    stats = IngestStats()
    source_bytes = sum(p.stat().st_size for p in source_files(source, split=split))
    writer = _OrderedWriter(Path(out_prompts), shuffle_seed, source_bytes)
    skipped = 0
    with atomic_open(out_skipped) as skipped_file, ImageTableWriter(out_images) as images:
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
                writer.add(_store_images(item, images))
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
        "%s: %d conversations from %d records of %s (%d invalid, %d duplicates, %d with an "
        "unreadable image; see %s); %d distinct images",
        dataset,
        count,
        stats.records,
        source,
        stats.invalid,
        stats.duplicates,
        stats.unreadable_images,
        out_skipped,
        len(images),
    )


def _store_images(conversation: Conversation, images: ImageTableWriter) -> Conversation:
    """Write a kept conversation's images; the conversation goes on without their bytes
    (the ordering holds thousands of conversations)."""
    if not conversation.images:
        return conversation
    for image in conversation.images:
        images.add(image)
    return replace(conversation, images=())


def _check_readable(dataset: str, source: str, stats: IngestStats, min_valid_share: float) -> None:
    """Skip mode must not pass a dataset it could not read."""
    if stats.records == 0:
        raise PromptFormatError(f"{source}: no records found (dataset {dataset})")
    if stats.valid_share >= min_valid_share:
        return
    common = ", ".join(f"{reason} ({n})" for reason, n in stats.reasons.most_common(3))
    raise PromptFormatError(
        f"{source}: only {stats.usable} of {stats.records} records are valid "
        f"({stats.valid_share:.0%}), below datasets.{dataset}.min_valid_share="
        f"{min_valid_share}; most common problems: {common} (the first skips are in the log)"
    )
