"""The generation driver: order, budget, sidecar, resume, progress, accounting.

It knows no engine. Finished prompts are appended to a sidecar journal
(``results/.work/...``) as they complete; the declared output is assembled from
the journal, atomically, only once the budget prefix is decided. A killed job
therefore loses at most the batch in flight, and a re-run counts every token
already in the journal against the budget.

Dispatch decisions depend only on the journal's content, never on timing, so an
interrupted and resumed run makes the same batches as an uninterrupted one and
(greedy decoding) writes byte-identical output.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .atomic import write_jsonl
from .budget import Outcome, Selection, plan_dispatch, select_prefix
from .engines import Completion, Engine, TurnFailure
from .journal import JournalWriter, read_journal

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    id: str
    prompt_hash: str
    messages: list[dict[str, str]]


@dataclass
class GenerationJob:
    dataset: str
    prompts: Sequence[Prompt]  # in the seeded order
    journal: Path
    model: str
    sampling: Mapping[str, Any]
    seed: int = 0
    token_budget: int | None = None
    max_samples: int | None = None
    batch_size: int = 8
    progress_interval_s: float = 10.0


@dataclass
class GenerationResult:
    rows: list[dict[str, Any]]
    stats: dict[str, Any]
    selection: Selection
    generated_now: int = 0  # prompts sent to the engine by this run
    failures: list[dict[str, Any]] = field(default_factory=list)


def _outcome(record: Mapping[str, Any]) -> Outcome:
    if record["status"] == "failed":
        return Outcome(0, failed=True)
    return Outcome(int(record["usage"]["completion_tokens"]))


def load_records(job: GenerationJob) -> dict[str, dict[str, Any]]:
    """Journal records of the current prompts (same id and same prompt text)."""
    wanted = {p.id: p.prompt_hash for p in job.prompts}
    records: dict[str, dict[str, Any]] = {}
    for rec in read_journal(job.journal):
        pid = rec.get("id")
        if wanted.get(pid) == rec.get("prompt_hash") and pid not in records:
            records[pid] = rec
    return records


def _batch_seed(seed: int, first_id: str, turn: int) -> int:
    digest = hashlib.sha256(f"{seed}\x00{first_id}\x00{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def regenerate(engine: Engine, prompts: Sequence[Prompt], seed: int) -> list[dict[str, Any]]:
    """Regenerate every assistant turn of each prompt, turn by turn, in order.

    Source assistant turns are dropped; after each user turn the engine answers
    on the regenerated history. A conversation fails as a whole if one of its
    turns fails.
    """
    history: list[list[dict[str, str]]] = []
    user_turns: list[list[dict[str, str]]] = []
    for p in prompts:
        system = [m for m in p.messages[:1] if m["role"] == "system"]
        history.append([dict(m) for m in system])
        user_turns.append([dict(m) for m in p.messages if m["role"] == "user"])
    turns: list[list[dict[str, Any]]] = [[] for _ in prompts]
    failed: dict[int, str] = {}
    n_rounds = max(len(u) for u in user_turns)
    for turn in range(n_rounds):
        active = [i for i, u in enumerate(user_turns) if turn < len(u) and i not in failed]
        if not active:
            break
        for i in active:
            history[i].append(user_turns[i][turn])
        results = engine.complete(
            [history[i] for i in active], seed=_batch_seed(seed, prompts[0].id, turn)
        )
        for i, res in zip(active, results, strict=True):
            if isinstance(res, TurnFailure):
                failed[i] = f"turn {turn + 1}: {res.reason}"
                continue
            assert isinstance(res, Completion)
            message: dict[str, str] = {"role": "assistant", "content": res.content}
            if res.reasoning_content:
                message["reasoning_content"] = res.reasoning_content
            history[i].append(message)
            turns[i].append(
                {
                    "finish_reason": res.finish_reason,
                    "prompt_tokens": res.prompt_tokens,
                    "completion_tokens": res.completion_tokens,
                }
            )
    records = []
    for i, p in enumerate(prompts):
        spent = sum(t["completion_tokens"] for t in turns[i])
        if i in failed:
            records.append(
                {
                    "id": p.id,
                    "prompt_hash": p.prompt_hash,
                    "status": "failed",
                    "error": failed[i],
                    "completion_tokens_spent": spent,
                }
            )
            continue
        records.append(
            {
                "id": p.id,
                "prompt_hash": p.prompt_hash,
                "status": "ok",
                "messages": history[i],
                "finish_reason": turns[i][-1]["finish_reason"],
                "usage": {
                    "prompt_tokens": sum(t["prompt_tokens"] for t in turns[i]),
                    "completion_tokens": spent,
                },
                "turns": turns[i],
            }
        )
    return records


class _Progress:
    """Throttled progress lines for the job log."""

    def __init__(self, job: GenerationJob, total: int) -> None:
        self.job = job
        self.total = total
        self.start = time.monotonic()
        self.last = 0.0
        self.generated = 0
        self.last_line = ""

    def update(
        self, sel: Selection, records: Mapping[str, dict[str, Any]], force: bool = False
    ) -> None:
        now = time.monotonic()
        if not force and now - self.last < self.job.progress_interval_s:
            return
        self.last = now
        ok = [r for r in records.values() if r["status"] == "ok"]
        avg = sum(r["usage"]["completion_tokens"] for r in ok) / len(ok) if ok else 0.0
        elapsed = max(now - self.start, 1e-9)
        rate = self.generated / elapsed
        done = len(sel.selected)
        expected_total = self.total
        if self.job.token_budget is not None and avg > 0:
            left = max(self.job.token_budget - sel.tokens, 0)
            expected_total = min(expected_total, done + int(left / avg))
        remaining = max(expected_total - done, 0)
        eta = f"{remaining / rate:.0f}s" if rate > 0 else "?"
        cap = self.job.token_budget
        if cap is None:
            budget = f"{sel.tokens}/unlimited"
        else:
            budget = f"{sel.tokens}/{cap} ({100 * sel.tokens / max(cap, 1):.0f}%)"
        line = (
            f"{self.job.dataset}: {done}/{expected_total} ({len(sel.failed)} err) "
            f"{rate:.2f} req/s avg_comp={avg:.0f}tok budget={budget} ETA={eta}"
        )
        if line != self.last_line:  # the final forced update often repeats the last one
            log.info("%s", line)
            self.last_line = line


def run_generation(job: GenerationJob, engine_factory: Any) -> GenerationResult:
    """Generate until the budget prefix is decided; return the final rows and stats.

    ``engine_factory`` is called only if something remains to be generated, so a
    re-run over a finished journal (e.g. a lowered budget) never loads a model.
    """
    order = [p.id for p in job.prompts]
    by_id = {p.id: p for p in job.prompts}
    limits = {"token_budget": job.token_budget, "max_samples": job.max_samples}
    total = min(len(order), job.max_samples) if job.max_samples is not None else len(order)
    progress = _Progress(job, total)
    engine: Engine | None = None
    generated_now = 0
    # Lock before reading: another writer finishing between our read and our
    # first append would otherwise make us regenerate what it just wrote.
    with JournalWriter(job.journal) as journal:
        if journal.repaired_bytes:
            log.warning(
                "%s: dropped a torn last record (%d bytes) from %s",
                job.dataset,
                journal.repaired_bytes,
                job.journal,
            )
        records = load_records(job)
        resumed = len(records)
        outcomes = {pid: _outcome(r) for pid, r in records.items()}
        sel = select_prefix(order, outcomes, **limits)
        log.info(
            "%s: %d prompts, %d finished records in %s%s",
            job.dataset,
            len(order),
            resumed,
            job.journal,
            " (resuming)" if resumed else "",
        )
        while not sel.complete:
            ok = [o.completion_tokens for o in outcomes.values() if not o.failed]
            expected = sum(ok) / len(ok) if ok else float(job.sampling["max_tokens"])
            batch = plan_dispatch(
                order, outcomes, sel, expected_tokens=expected, limit=job.batch_size, **limits
            )
            if engine is None:
                engine = engine_factory()
            new = regenerate(engine, [by_id[order[pos]] for pos in batch], job.seed)
            journal.append_many(new)
            for rec in new:
                records[rec["id"]] = rec
                outcomes[rec["id"]] = _outcome(rec)
            generated_now += len(new)
            progress.generated = generated_now
            sel = select_prefix(order, outcomes, **limits)
            progress.update(sel, records)
    progress.update(sel, records, force=True)
    return _assemble(job, order, records, sel, resumed, generated_now)


def _assemble(
    job: GenerationJob,
    order: list[str],
    records: Mapping[str, dict[str, Any]],
    sel: Selection,
    resumed: int,
    generated_now: int,
) -> GenerationResult:
    sampling = {**job.sampling, "seed": job.seed}
    rows = []
    for pos in sel.selected:
        rec = records[order[pos]]
        rows.append(
            {
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
        )
    failures = [
        {"id": order[pos], "index": pos, "error": records[order[pos]]["error"]}
        for pos in sel.failed
    ]
    generated_tokens = sum(
        r["usage"]["completion_tokens"] if r["status"] == "ok" else r["completion_tokens_spent"]
        for r in records.values()
    )
    truncated = sum(1 for r in rows if any(t["finish_reason"] == "length" for t in r["turns"]))
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
        "records_resumed": resumed,
        "records_generated_now": generated_now,
        "sidecar": str(job.journal),
        "failures": failures,
    }
    # The accounting invariant: every prompt is in exactly one bucket.
    assert stats["in_output"] + stats["failed"] + stats["beyond_limits"] == stats["prompts"]
    return GenerationResult(rows, stats, sel, generated_now, failures)


def write_outputs(result: GenerationResult, responses: Path) -> None:
    write_jsonl(responses, result.rows)
