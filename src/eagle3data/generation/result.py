"""The job's declared outputs, assembled from its journal once the budget prefix is decided:
the rows of the responses file, the failures, and the stats with the accounting invariant
(every prompt in exactly one bucket)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..atomic import write_jsonl
from .budget import Selection
from .engines import OVER_CONTEXT
from .job import GenerationJob, GenerationResult
from .records import AbandonedRecord, JournalRecord, spent_tokens

log = logging.getLogger(__name__)


def estimated_tokens(abandoned: Iterable[AbandonedRecord]) -> int:
    """The part of abandoned records' decode that no server reported."""
    return sum(r["completion_tokens_spent"] for r in abandoned if r["spent_source"] == "estimate")


def assemble(
    job: GenerationJob,
    order: list[str],
    records: Mapping[str, JournalRecord],
    sel: Selection,
    resumed: int,
    generated_now: int,
    engine_notes: Mapping[str, int] | None = None,
    abandoned: Sequence[AbandonedRecord] = (),
) -> GenerationResult:
    sampling = {**job.sampling, "seed": job.seed}
    rows = []
    for pos in sel.selected:
        rec = records[order[pos]]
        row = {
            "id": rec["id"],
            "dataset": job.dataset,
            "index": pos,
            "messages": rec["messages"],
            "finish_reason": rec["finish_reason"],
            "usage": rec["usage"],
            "turns": rec["turns"],
            "model": job.model,
            "sampling": sampling,
        }
        if "tools" in rec:  # tool-calling conversations only: plain rows are unchanged
            row["tools"] = rec["tools"]
        rows.append(row)
    failures = [failure_row(order[pos], pos, records[order[pos]]) for pos in sel.failed]
    abandoned_tokens = sum(spent_tokens(r) for r in abandoned)
    generated_tokens = sum(spent_tokens(r) for r in records.values()) + abandoned_tokens
    truncated = sum(1 for r in rows if any(t["finish_reason"] == "length" for t in r["turns"]))
    ids = token_id_counts(job.dataset, rows)
    stats = {
        "dataset": job.dataset,
        "prompts": len(order),
        "in_output": len(rows),
        "failed": len(failures),
        "beyond_limits": len(order) - sel.frontier,
        "stop_reason": sel.stop_reason,
        "token_budget": job.token_budget,
        "max_samples": job.max_samples,
        "completion_tokens": sel.tokens,
        "prompt_tokens": sum(r["usage"]["prompt_tokens"] for r in rows),
        "truncated": truncated,
        "generated_tokens_total": generated_tokens,
        "waste_tokens": generated_tokens - sel.tokens,
        # Conversations cancelled in flight (budget reached, or a stop): what the engine
        # decoded for them, in waste_tokens; the part no server reported is estimated.
        "abandoned_requests": len(abandoned),
        "abandoned_tokens": abandoned_tokens,
        "abandoned_tokens_estimated": estimated_tokens(abandoned),
        "records_resumed": resumed,
        "records_generated_now": generated_now,
        # Failures that do not fit the context: a server's 4xx, or an answer it cut there.
        "over_context": sum(1 for f in failures if f.get("kind") == OVER_CONTEXT),
        # Endpoints of this run asked in text: they refused return_token_ids or sent ids
        # in a shape we do not know (0 when nothing was generated now).
        "token_ids_fallbacks": int((engine_notes or {}).get("token_ids_fallbacks", 0)),
        # Files a capture server wrote for our requests that this job could not delete.
        "capture_files_left": int((engine_notes or {}).get("capture_files_left", 0)),
        **ids,
        "sidecar": str(job.journal),
        "failures": failures,
    }
    # The accounting invariant: every prompt is in exactly one bucket.
    assert stats["in_output"] + stats["failed"] + stats["beyond_limits"] == stats["prompts"]
    # The engine decoded the abandoned ones too: the report's throughput counts them.
    every = [*records.values(), *abandoned]
    return GenerationResult(rows, stats, sel, generated_now, failures, every)  # type: ignore[arg-type]


def failure_row(prompt_id: str, pos: int, record: Mapping[str, Any]) -> dict[str, Any]:
    """A line of errors.jsonl: the prompt, its position, the error and its kind if known."""
    row = {"id": prompt_id, "index": pos, "error": record["error"]}
    if "kind" in record:
        row["kind"] = record["kind"]
    return row


def token_id_counts(dataset: str, rows: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """How many assistant turns of the output kept the engine's token ids, and in how
    many the ids' length differs from ``usage.completion_tokens`` (which the budget
    counts): logged, since a server whose usage disagrees with its own ids counts the
    budget in other units than the data."""
    with_ids = without = mismatched = 0
    example = ""
    for row in rows:
        for k, turn in enumerate(row["turns"]):
            ids = turn.get("token_ids")
            if ids is None:
                without += 1
                continue
            with_ids += 1
            if len(ids["completion"]) != turn["completion_tokens"]:
                mismatched += 1
                example = example or (
                    f"{row['id']} turn {k + 1}: {len(ids['completion'])} ids, "
                    f"usage.completion_tokens {turn['completion_tokens']}"
                )
    if mismatched:
        log.warning(
            "%s: %d turn(s) whose completion ids disagree with usage.completion_tokens "
            "(the budget counts usage), e.g. %s",
            dataset,
            mismatched,
            example,
        )
    return {
        "turns_with_token_ids": with_ids,
        "turns_without_token_ids": without,
        "turns_usage_disagrees_with_ids": mismatched,
    }


def write_outputs(result: GenerationResult, responses: Path) -> None:
    write_jsonl(responses, result.rows)
