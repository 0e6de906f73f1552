"""The prompts stage: read one source, order it, write the prompts table and the skips."""

from __future__ import annotations

import logging

from ..atomic import write_jsonl
from .sources import read_prompts, seeded_order
from .table import write_prompts

log = logging.getLogger(__name__)


def prepare_prompts(
    *,
    dataset: str,
    source: str,
    fmt: str,
    on_invalid: str,
    shuffle_seed: int,
    out_prompts: str,
    out_skipped: str,
) -> None:
    parsed = read_prompts(source, fmt, on_invalid=on_invalid)  # type: ignore[arg-type]
    ordered = seeded_order(parsed.conversations, shuffle_seed)
    write_prompts(out_prompts, ordered)
    write_jsonl(out_skipped, [s.as_row() for s in parsed.skipped])
    log.info(
        "%s: %d conversations from %s (%d skipped, see %s)",
        dataset,
        len(ordered),
        source,
        len(parsed.skipped),
        out_skipped,
    )
    for s in parsed.skipped:
        log.warning("%s: skipped %s:%d: %s", dataset, s.file, s.line, s.reason)
