"""One generate job's run: the journal's records and outcomes, the budget's selection and
the lengths seen, the plans of what to send and what to cancel (:mod:`.budget`), and the
commit of finished records."""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from typing import Any

from ..servers.queue import SentBack
from .budget import (
    LengthFit,
    LengthModel,
    Outcome,
    hopeless_in_flight,
    plan_dispatch,
    plan_dispatch_tail,
    select_prefix,
)
from .job import GenerationJob
from .journal import JournalWriter, read_journal
from .records import (
    RECORD_STATUSES,
    AbandonedRecord,
    JournalRecord,
    counted_tokens,
    is_failed,
    is_outcome,
    spent_tokens,
    unknown_status,
)
from .run_state import Progress, ServedLog, TokenClock


def outcome_of(record: Mapping[str, Any]) -> Outcome:
    return Outcome(counted_tokens(record), failed=is_failed(record))


def load_journal(job: GenerationJob) -> tuple[dict[str, JournalRecord], list[AbandonedRecord]]:
    """The first outcome of each current prompt, and every abandoned record of the current
    prompts (what cancelled requests decoded: waste, never an outcome)."""
    wanted = {p.id: p.prompt_hash for p in job.prompts}
    records: dict[str, JournalRecord] = {}
    abandoned: list[AbandonedRecord] = []
    for lineno, rec in enumerate(read_journal(job.journal), start=1):  # a record a line
        status = rec.get("status") if isinstance(rec, dict) else None
        if status not in RECORD_STATUSES:
            raise unknown_status(str(job.journal), lineno, status)
        pid = rec.get("id")
        if wanted.get(pid) != rec.get("prompt_hash"):
            continue
        if not is_outcome(rec):
            abandoned.append(rec)  # type: ignore[arg-type]
        elif pid not in records:
            records[pid] = rec
    return records, abandoned


MIN_FIT = 16  # observed lengths before dispatch trusts their distribution


class Run:
    """State shared by the two dispatch loops: journal, outcomes, selection."""

    def __init__(self, job: GenerationJob, journal: JournalWriter) -> None:
        self.job = job
        self.journal = journal
        self.order = [p.id for p in job.prompts]
        self.by_id = {p.id: p for p in job.prompts}
        self.limits = {"token_budget": job.token_budget, "max_samples": job.max_samples}
        self.records, self.abandoned = load_journal(job)
        # Their decode, kept current by abandon(): every commit's progress line reads it.
        self.abandoned_tokens = sum(spent_tokens(r) for r in self.abandoned)
        self.resumed = len(self.records)
        self.outcomes = {pid: outcome_of(r) for pid, r in self.records.items()}
        total = (
            len(self.order) if job.max_samples is None else min(len(self.order), job.max_samples)
        )
        self.progress = Progress(job, total)
        self.generated_now = 0
        ok = [o.completion_tokens for o in self.outcomes.values() if not o.failed]
        self.ok_count, self.ok_tokens = len(ok), sum(ok)
        self.sel = select_prefix(self.order, self.outcomes, **self.limits)
        # Streaming dispatch near the end of a budget: the observed lengths (the journal's
        # first) and where each request in flight has got.
        self.lengths = LengthModel(job.sampling.get("max_tokens"))
        for tokens in ok:
            self.lengths.add(tokens)
        self.clock = TokenClock()
        self.engine_notes: dict[str, int] = {}  # the HTTP engine's counters (stats)
        self.served = ServedLog()
        # The servers that may hold requests sent back to their queue, and those whose
        # gauge was once found to count others' requests (said once each).
        self.sent_back = SentBack()
        self.gauges_not_ours: set[str] = set()

    def expected_tokens(self, capacity: int) -> float:
        """Running mean completion length; before anything is known, a prior that
        lets the first dispatch fill the engine: max_tokens would send a single
        request when max_tokens is large, leaving the engine idle for a whole
        request. Overshooting only costs waste: the budget is enforced at selection."""
        if self.ok_count:
            return self.ok_tokens / self.ok_count
        prior = float(self.job.sampling["max_tokens"])
        if self.job.token_budget is not None:
            prior = min(prior, max(self.job.token_budget / capacity, 1.0))
        return prior

    def plan(self, limit: int, in_flight: Collection[int] = ()) -> list[int]:
        """Positions to dispatch next. Near the end of a budget, a streaming run (requests
        in flight) plans with the observed length distribution and where each request in
        flight has got, so as not to overshoot when lengths are long-tailed. Otherwise
        (far from the end, the first lengths, in-process batches: nothing in flight)
        with the running mean, as before; batches stay a function of the journal."""
        if in_flight and self.near_end(len(in_flight) + limit):
            progress, fit = self._tail_fit(in_flight)
            if fit is not None:
                return plan_dispatch_tail(
                    self.order,
                    self.outcomes,
                    self.sel,
                    fit=fit,
                    in_flight=progress,
                    limit=limit,
                    p_fail=self.p_fail(),
                    **self.limits,
                )
        return plan_dispatch(
            self.order,
            self.outcomes,
            self.sel,
            expected_tokens=self.expected_tokens(limit + len(in_flight)),
            limit=limit,
            in_flight=in_flight,
            **self.limits,
        )

    def p_fail(self) -> float:
        """The share of this dataset's conversations that failed (a later turn over the
        context, a 4xx): the chance one in flight does, and spends nothing of the budget."""
        decided = len(self.outcomes)
        return (decided - self.ok_count) / decided if decided else 0.0

    def progress_in_flight(self) -> dict[int, float]:
        """The token clock's tokens so far of each request in flight."""
        return self.clock.progress(self.ok_tokens / max(self.ok_count, 1))

    def _tail_fit(self, in_flight: Collection[int]) -> tuple[dict[int, float], LengthFit | None]:
        """Where each request in flight has got, and the lengths fitted with them."""
        progress = self.progress_in_flight()
        progress = {p: progress.get(p, 0.0) for p in in_flight}
        return progress, self.lengths.fit(progress.values())

    def hopeless(self, in_flight: Collection[int]) -> set[int]:
        """Requests in flight the prefix will almost surely not need (near the end of a
        budget only): cancelling them saves what they would still decode."""
        if not in_flight or not self.near_end(len(in_flight)):
            return set()
        progress, fit = self._tail_fit(in_flight)
        if fit is None:
            return set()
        return hopeless_in_flight(
            self.order,
            self.outcomes,
            self.sel,
            token_budget=self.job.token_budget,
            fit=fit,
            in_flight=progress,
            p_fail=self.p_fail(),
        )

    def near_end(self, requests: int) -> bool:
        """Whether ``requests`` more could reach the budget, counted generously (twice
        the mean length of a request in flight): further away, both plans fill every
        free slot, and fitting the lengths would only cost time."""
        budget = self.job.token_budget
        if budget is None or len(self.lengths) < MIN_FIT:
            return False
        return self.ok_tokens + requests * 2 * self.lengths.in_flight_mean() >= budget

    def commit(self, new: list[JournalRecord]) -> None:
        # When a record was journaled: the status command's rate and ETA. Never copied
        # into the responses, which stay a function of the engine's outputs alone.
        finished_at = round(time.time(), 3)
        for rec in new:
            rec["finished_at"] = finished_at
        self.journal.append_many(new)
        for rec in new:
            outcome = outcome_of(rec)
            self.records[rec["id"]] = rec
            self.outcomes[rec["id"]] = outcome
            if not outcome.failed:
                self.ok_count += 1
                self.ok_tokens += outcome.completion_tokens
                self.lengths.add(outcome.completion_tokens)
            self.progress.tokens += rec.get("usage", {}).get("completion_tokens", 0)
        self.generated_now += len(new)
        self.progress.generated = self.generated_now
        self.sel = select_prefix(self.order, self.outcomes, **self.limits, resume_from=self.sel)
        self.progress.update(self.sel, self.records, abandoned_tokens=self.abandoned_tokens)

    def abandon(self, new: list[AbandonedRecord]) -> None:
        """Journal what cancelled conversations decoded (nothing of it is kept)."""
        finished_at = round(time.time(), 3)
        for rec in new:
            rec["finished_at"] = finished_at
        self.journal.append_many(new)  # type: ignore[arg-type]
        self.abandoned.extend(new)
        self.abandoned_tokens += sum(spent_tokens(r) for r in new)
        self.progress.cancelled += len(new)


def stopped_message(run: Run, by: str) -> str:
    """The one line a stopped generate job ends with: what is kept, and how to go on."""
    return (
        f"{run.job.dataset}: stopped by {by}; {run.generated_now} responses finished "
        f"in this run are kept ({len(run.records)} in {run.job.journal}); run the same command "
        "to resume"
    )
