"""The generation driver: order, budget, sidecar, resume, progress, accounting.

It knows no engine. Finished prompts are appended to a sidecar journal
(``results/.work/...``) as they complete; the declared output is assembled from
the journal, atomically, only once the budget prefix is decided. A killed job
therefore loses at most the batch in flight, and a re-run counts every token
already in the journal against the budget.

In-process engines get batches whose composition depends only on the
journal's content, never on timing, so an interrupted and resumed run makes the
same batches as an uninterrupted one and (greedy decoding) writes byte-identical
output. HTTP engines get single conversations as capacity frees up; which ones
are in flight depends on timing, but the output does not: it is the prefix
selected from the journal, and each conversation's answer depends only on the
conversation (for a deterministic server).

Tool calling: the source's assistant turns are regenerated wherever it had one, after
each user turn and after each run of tool turns, on the regenerated history so far plus
the source's system, user and tool turns in order; a conversation's ``tools`` go with
every request. Tools are never executed: the source's tool results stay as given, even
where a regenerated turn calls other tools (or none) than the source's did, so what the
target is shown stays a function of the source alone. Only their ``tool_call_id`` follows
the regenerated calls, when there are as many calls as results (``answering``): a
regenerated call's id is new, templates such as Kimi-K2.5's render both ids, and some
servers refuse a result that answers no call of the turn before (OpenAI's API; SGLang
0.5.23 for MiniMax-M3 only). With another number of calls the results stay as given; such
a server refuses that history and the prompt fails with its message, like any other 4xx.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
import signal
import statistics
import time
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from .. import __version__
from ..driver_signals import signal_name, stop_deferred
from ..errors import GenerationAborted, JournalCorruptError
from ..servers.queue import SentRequest, ServerQueue, queued_positions
from .budget import (
    LengthFit,
    LengthModel,
    Outcome,
    Selection,
    hopeless_in_flight,
    plan_dispatch,
    plan_dispatch_tail,
    select_prefix,
)
from .conversation import Conversation, regenerate
from .engines import (
    CURRENT_REQUEST,
    OVER_CONTEXT,
    AsyncEngine,
    Engine,
    RequestTrace,
    TransientError,
)
from .engines.endpoint_slots import SLOT_POLL_S
from .job import GenerationJob, GenerationResult, Prompt
from .journal import JournalWriter, read_journal
from .records import (
    RECORD_STATUSES,
    AbandonedRecord,
    JournalRecord,
    abandoned_record,
    counted_tokens,
    is_failed,
    is_outcome,
    spent_tokens,
)
from .result import assemble, estimated_tokens, write_outputs

log = logging.getLogger(__name__)

# The stage's API (what the stage function, tests and benchmarks import from here); the
# job's data, a conversation's turns and the outputs live in job.py, conversation.py and
# result.py.
__all__ = [
    "ErrorLimits",
    "GenerationJob",
    "GenerationResult",
    "Prompt",
    "load_journal",
    "regenerate",
    "run_generation",
    "stopped_message",
    "write_outputs",
]


def _outcome(record: Mapping[str, Any]) -> Outcome:
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
            # Builds from before "abandoned" read such a record as an outcome and crashed
            # deep inside; from here on a kind this build does not know is named.
            raise JournalCorruptError(
                f"{job.journal}:{lineno}: a record of status {status!r}, which this build "
                f"(eagle3data {__version__}) does not know (it reads "
                f"{', '.join(RECORD_STATUSES)}): a newer eagle3data wrote it; run that one, "
                "or move the journal away to generate again"
            )
        pid = rec.get("id")
        if wanted.get(pid) != rec.get("prompt_hash"):
            continue
        if not is_outcome(rec):
            abandoned.append(rec)  # type: ignore[arg-type]
        elif pid not in records:
            records[pid] = rec
    return records, abandoned


class _Progress:
    """Throttled progress lines for the job log."""

    def __init__(self, job: GenerationJob, total: int) -> None:
        self.job = job
        self.total = total
        self.start = time.monotonic()
        self.last = 0.0
        self.generated = 0
        self.tokens = 0  # completion tokens generated by this run
        self.in_flight = 0
        self.transient_errors = 0
        self.cancelled = 0
        self.last_line = ""

    def update(
        self,
        sel: Selection,
        records: Mapping[str, JournalRecord],
        force: bool = False,
        abandoned_tokens: int = 0,
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
        generated = sum(spent_tokens(r) for r in records.values()) + abandoned_tokens
        line = (
            f"{self.job.dataset}: {done}/{expected_total} "
            f"({len(sel.failed)} err, {self.transient_errors} retried) "
            f"{rate:.2f} req/s {self.tokens / elapsed:.0f} tok/s avg_comp={avg:.0f}tok "
            f"budget={budget} inflight={self.in_flight} waste={generated - sel.tokens}tok "
            f"ETA={eta}"
        )
        if line != self.last_line:  # the final forced update often repeats the last one
            log.info("%s", line)
            self.last_line = line


@dataclass(frozen=True)
class ErrorLimits:
    """When a run stops instead of burning through a dataset on a broken server."""

    max_consecutive_failures: int = 20
    max_error_rate: float = 0.5
    min_attempts: int = 20  # attempts before the rate is judged


class _FailureTracker:
    """Consecutive and total failures of a streaming run, judged against ErrorLimits."""

    def __init__(self, dataset: str, limits: ErrorLimits) -> None:
        self.dataset = dataset
        self.limits = limits
        self.attempts = self.errors = self.consecutive = 0

    def record(self, *, failed: bool) -> None:
        self.attempts += 1
        self.errors += failed
        self.consecutive = self.consecutive + 1 if failed else 0

    def check(self) -> None:
        """Raise GenerationAborted once a limit is exceeded."""
        limits = self.limits
        if self.consecutive >= limits.max_consecutive_failures:
            raise GenerationAborted(
                f"{self.dataset}: {self.consecutive} consecutive failures; stopping "
                "(the server looks broken; finished responses are kept, re-run to resume)"
            )
        if self.attempts >= limits.min_attempts and (
            self.errors / self.attempts > limits.max_error_rate
        ):
            raise GenerationAborted(
                f"{self.dataset}: {self.errors} of {self.attempts} attempts failed "
                f"(> {limits.max_error_rate:.0%}); stopping (finished responses are kept)"
            )


_MIN_FIT = 16  # observed lengths before dispatch trusts their distribution


class _TokenClock:
    """How many tokens each request in flight has generated so far, estimated from the
    completions alone (their order and lengths), so that dispatch is a function of them.

    ``now`` advances like an engine slot that is never idle: a request dispatched at clock
    c and finished with n tokens moves it to at least c + n. A request dispatched at c has
    then generated about ``now - c`` tokens, less the usual lag (the clock time a request
    spends not generating: queueing, prefill). When that lag is large, requests wait in a
    server-side queue (more in flight than the engine runs) and elapsed time says little;
    only the ordering bound is kept: with FIFO service and equal speeds, a request still
    running after a later one finished with n tokens has generated more than n. A request
    a server's queue gauge shows waiting has generated nothing yet; its clock starts again
    when the gauge first shows it decoding.
    """

    def __init__(self) -> None:
        self.now = 0.0
        self._seq = 0
        self._started: dict[int, tuple[int, float]] = {}  # pos -> (dispatch order, clock)
        self._floor: dict[int, int] = {}  # pos -> ordering lower bound
        self._waiting: set[int] = set()  # in a server's queue, by its gauge
        self._lags: deque[float] = deque(maxlen=64)

    def dispatched(self, pos: int) -> None:
        """Sent, or (again) seen decoding for the first time by a queue gauge."""
        self._started[pos] = (self._seq, self.now)
        self._seq += 1
        # Ordering bounds hold from the start of decoding (a waiting one got them wrongly).
        self._floor.pop(pos, None)
        self._waiting.discard(pos)

    def waiting(self, pos: int) -> None:
        """Seen waiting in a server's queue."""
        if pos in self._started:
            self._waiting.add(pos)

    def is_waiting(self, pos: int) -> bool:
        return pos in self._waiting

    def dropped(self, pos: int) -> None:
        """A request that ended without a result (it will be dispatched again)."""
        self._started.pop(pos, None)
        self._floor.pop(pos, None)
        self._waiting.discard(pos)

    def finished(self, pos: int, tokens: int) -> None:
        started = self._started.get(pos)
        self.dropped(pos)
        if started is None:
            return
        seq, at = started
        for other, (other_seq, _) in self._started.items():
            if other_seq < seq and self._floor.get(other, 0) < tokens:
                self._floor[other] = tokens
        self._lags.append(max(self.now - at - tokens, 0.0))
        self.now = max(self.now, at + tokens)

    def progress(self, typical: float) -> dict[int, float]:
        """Tokens generated so far by each request in flight; ``typical`` is a typical
        completion length (the lag is judged against it)."""
        lag = statistics.median(self._lags) if self._lags else 0.0
        queued = lag > typical / 4
        return {
            pos: 0.0
            if pos in self._waiting
            else float(max(self._floor.get(pos, 0), 0.0 if queued else self.now - at - lag))
            for pos, (_, at) in self._started.items()
        }


class _ServedLog:
    """The requests seen to finish on each endpoint: when each was sent and what its answer
    decoded. Under first-come-first-served scheduling a request sent earlier to the same
    endpoint started no later and decodes as fast, so one still in flight has decoded at
    least as much as any later one that finished: a floor on a cancelled request's decode
    that needs no queue gauge (a gauge can be stale or read the order wrongly)."""

    def __init__(self, keep: int = 4096) -> None:
        self._recent: deque[tuple[str, float, int]] = deque(maxlen=keep)
        self._rates: deque[float] = deque(maxlen=256)  # tokens per second in flight

    def finished(self, trace: RequestTrace, tokens: int) -> None:
        if trace.endpoint is not None and trace.sent_at is not None:
            self._recent.append((trace.endpoint, trace.sent_at, tokens))
            took = time.monotonic() - trace.sent_at
            if took > 0 and tokens > 0:
                self._rates.append(tokens / took)

    def rate(self) -> float:
        """Tokens a request decodes per second in flight (the median of recent answers,
        whose time includes their prefill and any wait in the queue, so on the low side)."""
        return statistics.median(self._rates) if self._rates else 0.0

    def decoded_at_least(self, traces: Sequence[RequestTrace]) -> list[int]:
        """For each request still in flight, the most decoded by one sent after it to the
        same endpoint that has finished (0 if none)."""
        by_endpoint: dict[str, list[tuple[float, int]]] = {}
        for endpoint, sent_at, tokens in self._recent:
            by_endpoint.setdefault(endpoint, []).append((sent_at, tokens))
        latest_max = {}  # endpoint -> (send times ascending, max tokens from there on)
        for endpoint, served in by_endpoint.items():
            served.sort()
            tokens_from = list(accumulate(reversed([n for _, n in served]), max))[::-1]
            latest_max[endpoint] = ([t for t, _ in served], tokens_from)
        out = []
        for trace in traces:
            times, tokens_from = latest_max.get(trace.endpoint or "", ([], []))
            i = bisect.bisect_right(times, trace.sent_at) if trace.sent_at is not None else 0
            out.append(tokens_from[i] if trace.sent_at is not None and i < len(times) else 0)
        return out


class _Run:
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
        self.outcomes = {pid: _outcome(r) for pid, r in self.records.items()}
        total = (
            len(self.order) if job.max_samples is None else min(len(self.order), job.max_samples)
        )
        self.progress = _Progress(job, total)
        self.generated_now = 0
        ok = [o.completion_tokens for o in self.outcomes.values() if not o.failed]
        self.ok_count, self.ok_tokens = len(ok), sum(ok)
        self.sel = select_prefix(self.order, self.outcomes, **self.limits)
        # Streaming dispatch near the end of a budget: the observed lengths (the journal's
        # first) and where each request in flight has got.
        self.lengths = LengthModel(job.sampling.get("max_tokens"))
        for tokens in ok:
            self.lengths.add(tokens)
        self.clock = _TokenClock()
        self.engine_notes: dict[str, int] = {}  # the HTTP engine's counters (stats)
        self.served = _ServedLog()
        # Each server's preemption counter at its gauge's first reading, and the servers
        # whose gauge was once found to count others' requests (said once each).
        self.preemptions_before: dict[str, int | None] = {}
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
        if budget is None or len(self.lengths) < _MIN_FIT:
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
            outcome = _outcome(rec)
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


def run_generation(
    job: GenerationJob,
    engine_factory: Any,
    *,
    streaming: bool = False,
    error_limits: ErrorLimits | None = None,
) -> GenerationResult:
    """Generate until the budget prefix is decided; return the final rows and stats.

    ``engine_factory`` is called only if something remains to be generated, so a
    re-run over a finished journal (e.g. a lowered budget) never loads a model.
    With ``streaming`` it must return an :class:`AsyncEngine` (HTTP): requests
    are kept in flight up to its capacity and each finished conversation is
    journaled at once; otherwise an in-process :class:`Engine` gets batches.
    """
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
        run = _Run(job, journal)
        log.info(
            "%s: %d prompts, %d finished records in %s%s",
            job.dataset,
            len(run.order),
            run.resumed,
            job.journal,
            " (resuming)" if run.resumed else "",
        )
        if not run.sel.complete:
            try:
                if streaming:
                    asyncio.run(_stream(run, engine_factory, error_limits or ErrorLimits()))
                else:
                    _batched(run, engine_factory)
            except KeyboardInterrupt as stop:  # SIGINT, or SIGTERM (driver_signals)
                raise GenerationAborted(stopped_message(run, signal_name(stop))) from None
    run.progress.update(run.sel, run.records, force=True, abandoned_tokens=run.abandoned_tokens)
    return assemble(
        job,
        run.order,
        run.records,
        run.sel,
        run.resumed,
        run.generated_now,
        run.engine_notes,
        run.abandoned,
    )


def _batched(run: _Run, engine_factory: Any) -> None:
    """In-process engines: deterministic batches, each journaled as a whole."""
    engine: Engine = engine_factory()
    while not run.sel.complete:
        batch = run.plan(run.job.batch_size)
        new = regenerate(engine, [run.by_id[run.order[pos]] for pos in batch], run.job.seed)
        # A stop between the append and the counts would say fewer responses are kept
        # than the journal holds.
        with stop_deferred():
            run.commit(new)


@dataclass
class _InFlight:
    """A conversation in flight: its position, its turns so far and its current request."""

    pos: int
    conversation: Conversation
    trace: RequestTrace = field(default_factory=RequestTrace)
    # time.monotonic() when a queue gauge first showed it decoding (not in the server's queue)
    started_at: float | None = None


async def _converse(engine: AsyncEngine, flight: _InFlight) -> JournalRecord:
    CURRENT_REQUEST.set(flight.trace)  # this task's own context: the engine fills it in
    conv = flight.conversation
    while (request := conv.next_request()) is not None:
        conv.add(await engine.complete(request, **conv.tools_kwargs()))
    return conv.record()


def _unused_slot_back(engine: Any, flight: _InFlight) -> None:
    """A conversation's task ended: the room taken for its first request goes back if
    that request never took it (cancelled first, even before the task ran)."""
    if flight.trace.slot is not None:
        slot, flight.trace.slot = flight.trace.slot, None
        engine.return_slot(slot)


def _abandoned(
    run: _Run, flights: Sequence[_InFlight], *, queued: bool = False
) -> list[AbandonedRecord]:
    """Records of conversations cancelled in flight: the turns they finished, and what the
    cancelled request had decoded, as the server said or else estimated: never below what
    a later request on its server finished with (:class:`_ServedLog`); for one ``queued``
    in the server by its gauge, that floor alone; otherwise the most of the floor, the token
    clock and the time since a gauge showed it decoding, within max_tokens. A request that
    was never sent decoded nothing."""
    progress = run.progress_in_flight() if flights else {}
    at_least = run.served.decoded_at_least([flight.trace for flight in flights])
    rate, now = run.served.rate(), time.monotonic()
    max_tokens = run.job.sampling.get("max_tokens")
    out = []
    for flight, floor in zip(flights, at_least, strict=True):
        conv = flight.conversation
        finished = sum(t["completion_tokens"] for t in conv.turns)
        decoded, estimated = flight.trace.decoded_on_cancel, False
        if decoded is None and flight.trace.sent_at is None:
            decoded = 0
        elif decoded is None and queued:
            decoded, estimated = floor, True
        elif decoded is None:
            clocked = round(progress.get(flight.pos, 0.0)) - finished
            # The token clock moves only with answers, so near the end (few of them) it
            # lags: where a gauge showed the request decoding, time at the usual rate.
            timed = 0
            if flight.started_at is not None and not run.clock.is_waiting(flight.pos):
                since = max(flight.started_at, flight.trace.sent_at)
                timed = round(rate * (now - since))
            decoded, estimated = max(clocked, floor, timed, 0), True
            if max_tokens is not None:
                decoded = min(decoded, int(max_tokens))
        prompt = conv.prompt
        out.append(
            abandoned_record(prompt.id, prompt.prompt_hash, finished + decoded, estimated=estimated)
        )
    return out


async def _cancel(
    run: _Run, flights: Mapping[asyncio.Task[JournalRecord], _InFlight], *, queued: bool = False
) -> None:
    """Cancel these conversations and wait for them: one that finished before the cancel
    took is kept like any other (beyond the prefix, or a stop's last answers); the others
    are journaled as abandoned, their decode waste. The engine frees each request on its
    server (vLLM: the closed connection; SGLang: an abort by request id) and says what it
    had decoded where the server tells."""
    for task in flights:
        task.cancel()
    await asyncio.gather(*flights, return_exceptions=True)
    ended = {t: t.result() for t in flights if not t.cancelled() and t.exception() is None}
    finished = list(ended.values())
    # Cancelled, or ended by a transient error on the way out (a dropped connection): it
    # decoded what it decoded. Any other exception is a bug: raised once the rest is kept.
    broken = [
        t.exception()
        for t in flights
        if not t.cancelled() and not isinstance(t.exception(), TransientError | type(None))
    ]
    cancelled = [
        flight
        for t, flight in flights.items()
        if t not in ended and (t.cancelled() or isinstance(t.exception(), TransientError))
    ]
    for flight in cancelled:
        run.clock.dropped(flight.pos)
    for task, record in ended.items():
        run.clock.finished(flights[task].pos, spent_tokens(record))
    with stop_deferred():
        abandoned = _abandoned(run, cancelled, queued=queued)
        run.abandon(abandoned)
        if finished:
            run.commit(finished)
    log.info(
        "%s: cancelled %d requests %s (%d tokens decoded for them, %d of them estimated); "
        "kept %d that had finished",
        run.job.dataset,
        len(cancelled),
        "waiting in the server's queue" if queued else "in flight",
        sum(spent_tokens(r) for r in abandoned),
        estimated_tokens(abandoned),
        len(finished),
    )
    if broken:
        raise broken[0]


QUEUE_POLL_S = 0.1  # how often the servers' queue gauges are read, at most
# A reading costs the server about what it takes to answer (vLLM renders all its metrics
# in its API process): the next waits at least this many times that, so the gauges take
# under 1/GAUGE_COST_SHARE of the server's time (SGLang's /v1/loads: every 0.1 s).
GAUGE_COST_SHARE = 50


async def _follow_queues(
    run: _Run, engine: Any, in_flight: dict[asyncio.Task[JournalRecord], _InFlight]
) -> float:
    """Read the servers' queues: a conversation seen decoding for the first time starts
    its token clock now (not when it was sent: it waited in the queue meanwhile); near the
    end of the budget, conversations still waiting in a queue that the plan would no
    longer send are cancelled, which costs nothing, and come back undecided. Returns the
    seconds the reading took."""
    asked = time.monotonic()
    queues = await engine.server_queues()
    took = time.monotonic() - asked
    for endpoint, queue in queues.items():  # counted from the first reading on
        run.preemptions_before.setdefault(endpoint, queue.preemptions)
    requests = [SentRequest(f.pos, f.trace.endpoint, f.trace.sent_at) for f in in_flight.values()]
    queued = queued_positions(requests, queues, run.preemptions_before)
    _say_unattributable(run, requests, queues)
    for flight in in_flight.values():
        if flight.pos in queued:
            if not flight.conversation.turns:  # a later turn's clock holds the earlier ones
                run.clock.waiting(flight.pos)
        elif flight.started_at is None or run.clock.is_waiting(flight.pos):
            flight.started_at = time.monotonic()
            run.clock.dispatched(flight.pos)
    # Only a first turn: cancelling a later one would throw the earlier turns away.
    waiting = {t: f for t, f in in_flight.items() if f.pos in queued and not f.conversation.turns}
    running = {f.pos for t, f in in_flight.items() if t not in waiting}
    cancel = unneeded_waiting(run, running, {f.pos for f in waiting.values()})
    unneeded = {t: f for t, f in waiting.items() if f.pos in cancel}
    if unneeded:
        for task in unneeded:
            del in_flight[task]
        await _cancel(run, unneeded, queued=True)
    return took


def _say_unattributable(
    run: _Run, requests: Sequence[SentRequest], queues: Mapping[str, ServerQueue]
) -> None:
    """Once per server: its gauge counts more than this job's requests, so its waiting
    ones are not read as ours (servers.queue.ServerQueue.attributable)."""
    ours: dict[str, int] = {}
    for request in requests:
        if request.endpoint is not None and request.sent_at is not None:
            ours[request.endpoint] = ours.get(request.endpoint, 0) + 1
    for endpoint, queue in queues.items():
        before = run.preemptions_before.get(endpoint)
        if endpoint in run.gauges_not_ours or queue.attributable(ours.get(endpoint, 0), before):
            continue
        run.gauges_not_ours.add(endpoint)
        log.info(
            "%s: %s's queue holds requests that are not this job's (%d running, %d waiting "
            "for our %d; another client, several data-parallel queues or preemptions): its "
            "waiting requests are not taken for ours, nothing decoding is cancelled as free",
            run.job.dataset,
            endpoint,
            queue.running,
            queue.waiting,
            ours.get(endpoint, 0),
        )


async def _cancel_hopeless(
    run: _Run, in_flight: dict[asyncio.Task[JournalRecord], _InFlight]
) -> None:
    """Near the end, cancel the conversations in flight the prefix will almost surely not
    need (those before them have surely reached the budget, or very likely will): what
    they would still decode is saved; one needed after all is sent again."""
    hopeless = run.hopeless({flight.pos for flight in in_flight.values()})
    doomed = {task: flight for task, flight in in_flight.items() if flight.pos in hopeless}
    if doomed:
        for task in doomed:
            del in_flight[task]
        await _cancel(run, doomed)


def unneeded_waiting(run: _Run, running: Collection[int], waiting: Collection[int]) -> set[int]:
    """Of the conversations waiting in a server's queue, those the plan would not send now
    if they had not been sent: near the end of the budget, cancelling them costs nothing
    and keeps the server from starting what the prefix will likely not need. Far from the
    end, none: the queue keeps the server full."""
    if not waiting or not run.near_end(len(running) + len(waiting)):
        return set()
    # No cap but the plan's own (positions not sent yet may come before a waiting one): a
    # cap would give back waiting requests the plan wants.
    wanted = set(run.plan(len(run.order), set(running)))
    return {pos for pos in waiting if pos not in wanted}


async def _stream(run: _Run, engine_factory: Any, limits: ErrorLimits) -> None:
    """HTTP engines: keep ``capacity`` conversations in flight, journal each one
    as it finishes, and cancel what can no longer enter the prefix."""
    engine: AsyncEngine = engine_factory()
    stop = asyncio.Event()
    stop_reason: list[str] = []
    loop = asyncio.get_running_loop()

    def request_stop(sig: signal.Signals) -> None:
        stop_reason.append(sig.name)
        stop.set()

    handled = []
    # The job's own handlers (driver_signals.stop_on_signals) come back afterwards:
    # removing a loop's handler would leave the default one instead.
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, request_stop, sig)
            handled.append(sig)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    in_flight: dict[asyncio.Task[JournalRecord], _InFlight] = {}
    failures = _FailureTracker(run.job.dataset, limits)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await engine.start()
        follow_queues = bool(getattr(engine, "reports_queues", False))
        # Endpoints shared with the run's other jobs: a conversation is sent only with room
        # for it, so the in-flight set (and every plan made with it) holds only what the
        # servers have, never conversations waiting for another job's requests to end.
        take_slots = engine.take_slots if getattr(engine, "shares_slots", False) else None
        last_poll, poll_every = -math.inf, QUEUE_POLL_S
        while not run.sel.complete and not stop.is_set():
            # Near the end only: further away nothing is cancelled, and the polls cost the
            # server (vLLM's /metrics on its API process) throughput.
            polling = follow_queues and bool(in_flight) and run.near_end(len(in_flight))
            if polling and time.monotonic() - last_poll >= poll_every:
                last_poll = time.monotonic()
                took = await _follow_queues(run, engine, in_flight)
                poll_every = max(QUEUE_POLL_S, GAUGE_COST_SHARE * took)
                if run.sel.complete:  # an answer kept while cancelling decided the prefix
                    break
            free = engine.capacity - len(in_flight)
            busy = {flight.pos for flight in in_flight.values()}
            planned = run.plan(free, busy) if free > 0 else []
            slots: list[Any] = [None] * len(planned)
            waiting_for_slots = False
            if take_slots is not None:
                slots = take_slots(len(planned))  # fewer when the other jobs hold the rest
                waiting_for_slots = len(slots) < len(planned)
                planned = planned[: len(slots)]  # the plan's first: it is in order
            for pos, slot in zip(planned, slots, strict=True):
                flight = _InFlight(pos, Conversation(run.by_id[run.order[pos]]))
                task = asyncio.ensure_future(_converse(engine, flight))
                if slot is not None:
                    flight.trace.slot = slot
                    task.add_done_callback(lambda _, f=flight: _unused_slot_back(engine, f))
                in_flight[task] = flight
                # Again when a queue gauge first shows it decoding (_follow_queues).
                run.clock.dispatched(pos)
            run.progress.in_flight = len(in_flight)
            if not in_flight and not waiting_for_slots:
                raise AssertionError("nothing in flight for an undecided prefix")  # unreachable
            timeout = poll_every if polling else None
            if waiting_for_slots:  # slots the other jobs free are seen only by looking
                timeout = SLOT_POLL_S
            done, _ = await asyncio.wait(
                [*in_flight, stopper],
                timeout=timeout,
                return_when=asyncio.FIRST_COMPLETED,
            )
            finished = []
            for task in done:
                if task is stopper:
                    continue
                flight = in_flight.pop(task)
                pos = flight.pos
                try:
                    record = task.result()
                except TransientError as exc:
                    run.clock.dropped(pos)
                    failures.record(failed=True)
                    run.progress.transient_errors += 1
                    log.warning("%s: %s (will retry later)", run.order[pos], exc)
                    continue
                run.clock.finished(pos, spent_tokens(record))
                finished.append(record)
                failed = is_failed(record)
                if not failed:
                    run.served.finished(flight.trace, record["turns"][-1]["completion_tokens"])
                # A prompt too long for the context says nothing about the server.
                failures.record(failed=failed and record.get("kind") != OVER_CONTEXT)
                if failed:
                    log.warning("%s: failed: %s", record["id"], record["error"])
            if finished:
                run.commit(finished)
                if follow_queues:  # without a gauge, a waiting request's progress is unknown
                    await _cancel_hopeless(run, in_flight)
            failures.check()
        if stop.is_set():
            raise GenerationAborted(stopped_message(run, stop_reason[0]))
    finally:
        stopper.cancel()
        await asyncio.gather(stopper, return_exceptions=True)
        if in_flight:
            await _cancel(run, in_flight)
        for sig in handled:
            loop.remove_signal_handler(sig)
            signal.signal(sig, previous[sig])
        run.engine_notes.update(getattr(engine, "notes", {}))
        await engine.close()


def stopped_message(run: _Run, by: str) -> str:
    """The one line a stopped generate job ends with: what is kept, and how to go on."""
    return (
        f"{run.job.dataset}: stopped by {by}; {run.generated_now} responses finished "
        f"in this run are kept ({len(run.records)} in {run.job.journal}); run the same command "
        "to resume"
    )
