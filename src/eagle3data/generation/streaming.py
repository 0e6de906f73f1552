"""Streaming dispatch for HTTP engines: conversations sent as room frees up, the servers'
queues followed near the end of the budget, and in-flight conversations cancelled when the
prefix is decided without them (their decoded tokens journaled as abandoned waste)."""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..driver_signals import stop_deferred
from ..errors import GenerationAborted
from ..servers.queue import SentRequest, ServerQueue, queued_positions
from .conversation import Conversation
from .engines import (
    CURRENT_REQUEST,
    OVER_CONTEXT,
    AsyncEngine,
    RequestTrace,
    TransientError,
)
from .engines.endpoint_slots import SLOT_POLL_S
from .records import (
    AbandonedRecord,
    JournalRecord,
    abandoned_record,
    is_failed,
    spent_tokens,
)
from .result import estimated_tokens
from .run import Run, stopped_message
from .run_state import ErrorLimits, FailureTracker

log = logging.getLogger(__name__)


@dataclass
class InFlight:
    """A conversation in flight: its position, its turns so far and its current request."""

    pos: int
    conversation: Conversation
    trace: RequestTrace = field(default_factory=RequestTrace)
    # time.monotonic() when a queue gauge first showed it decoding (not in the server's queue)
    started_at: float | None = None


async def _converse(engine: AsyncEngine, flight: InFlight) -> JournalRecord:
    CURRENT_REQUEST.set(flight.trace)  # this task's own context: the engine fills it in
    conv = flight.conversation
    while (request := conv.next_request()) is not None:
        conv.add(await engine.complete(request, **conv.tools_kwargs()))
    return conv.record()


def _unused_slot_back(engine: Any, flight: InFlight) -> None:
    """A conversation's task ended: the room taken for its first request goes back if
    that request never took it (cancelled first, even before the task ran)."""
    if flight.trace.slot is not None:
        slot, flight.trace.slot = flight.trace.slot, None
        engine.return_slot(slot)


def _abandoned(
    run: Run, flights: Sequence[InFlight], *, queued: bool = False
) -> list[AbandonedRecord]:
    """Records of conversations cancelled in flight: the turns they finished, and what the
    cancelled request had decoded, as the server said or else estimated: never below what
    a later request on its server finished with (:class:`ServedLog`); for one ``queued``
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
    run: Run, flights: Mapping[asyncio.Task[JournalRecord], InFlight], *, queued: bool = False
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
    run: Run, engine: Any, in_flight: dict[asyncio.Task[JournalRecord], InFlight]
) -> float:
    """Read the servers' queues: a conversation seen decoding for the first time starts
    its token clock now (not when it was sent: it waited in the queue meanwhile); near the
    end of the budget, conversations still waiting in a queue that the plan would no
    longer send are cancelled, which costs nothing, and come back undecided. Returns the
    seconds the reading took."""
    asked = time.monotonic()
    queues = await engine.server_queues()
    took = time.monotonic() - asked
    run.sent_back.update(queues)
    requests = [SentRequest(f.pos, f.trace.endpoint, f.trace.sent_at) for f in in_flight.values()]
    queued = queued_positions(requests, queues, run.sent_back.endpoints)
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
    run: Run, requests: Sequence[SentRequest], queues: Mapping[str, ServerQueue]
) -> None:
    """Once per server: its gauge cannot be read as this job's alone, so its waiting
    requests are not taken for ours (servers.queue.ServerQueue.attributable)."""
    ours: dict[str, int] = {}
    for request in requests:
        if request.endpoint is not None and request.sent_at is not None:
            ours[request.endpoint] = ours.get(request.endpoint, 0) + 1
    for endpoint, queue in queues.items():
        sent_back = endpoint in run.sent_back.endpoints
        if endpoint in run.gauges_not_ours or queue.attributable(ours.get(endpoint, 0), sent_back):
            continue
        run.gauges_not_ours.add(endpoint)
        log.info(
            "%s: %s's waiting requests are not taken for ours (%d running, %d waiting for our "
            "%d: another client, several data-parallel queues, or requests it sent back to "
            "its queue after decoding them, preempted or retracted); nothing decoding is "
            "cancelled as free",
            run.job.dataset,
            endpoint,
            queue.running,
            queue.waiting,
            ours.get(endpoint, 0),
        )


async def _cancel_hopeless(
    run: Run, in_flight: dict[asyncio.Task[JournalRecord], InFlight]
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


def unneeded_waiting(run: Run, running: Collection[int], waiting: Collection[int]) -> set[int]:
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


async def stream(run: Run, engine_factory: Any, limits: ErrorLimits) -> None:
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
    in_flight: dict[asyncio.Task[JournalRecord], InFlight] = {}
    failures = FailureTracker(run.job.dataset, limits)
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
                flight = InFlight(pos, Conversation(run.by_id[run.order[pos]]))
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
