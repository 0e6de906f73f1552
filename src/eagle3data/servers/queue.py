"""How many requests a server runs and how many wait in its queue, from its own gauges.

An operator keeps an SGLang or vLLM server full by sending more requests than it has decode
slots; the rest wait in the server's queue. Near the end of a budget the driver needs to
know which of its requests have started decoding (their tokens are spent) and which still
wait (cancelling them costs nothing): :func:`queued_positions`. Both servers schedule
first come, first served by default (SGLang ``--schedule-policy fcfs``, vLLM's FCFS), so of
one client's requests on one server the newest ``waiting`` ones are those still queued.

That reading holds only where the gauge counts this client's requests alone, in one queue,
none of them sent back to it after decoding. It does not (:meth:`ServerQueue.attributable`)
when the server holds more requests than this client has there (another client: the other
datasets' jobs, a capture job on the same server, someone else), when several data-parallel
ranks keep a queue each (requests are spread over them, so the newest overall are not the
ones waiting), or when the server has sent decoding requests back to its queue (vLLM
preempts, SGLang retracts them when the KV cache is full: they wait again with what they
decoded, among the oldest), until a reading shows its queue empty (:class:`SentBack`). The
gauge is then not used that time: nothing of ours is read as waiting, so nothing decoding is
cancelled as "free".

Where the gauges are:

* SGLang 0.5.23: ``GET /v1/loads?include=core,queues``, per data-parallel rank
  ``num_running_reqs`` and ``num_waiting_reqs`` (no ``--enable-metrics`` needed), and
  ``queues.retracted``: how many requests its last retraction sent back, kept until its next
  decode-stats log (40 decode steps; seen for ~0.3 s on the CPU server), so a retraction
  between two readings can go unseen;
* vLLM 0.32: ``GET /metrics`` (Prometheus text, always on), ``vllm:num_requests_running``
  and ``vllm:num_requests_waiting``, one sample per engine, and the counter
  ``vllm:num_preemptions_total``.

Other servers (llama.cpp) report none: the driver then plans without them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class ServerQueue:
    running: int  # requests decoding now (all clients')
    waiting: int  # requests in the server's queue, not started (or sent back: preempted)
    queues_waiting: int = 0  # data-parallel ranks (engines) with requests waiting
    preemptions: int | None = None  # vLLM's preemptions so far (a counter); None: unsaid
    retracted: bool = False  # SGLang says it lately sent decoding requests back to the queue

    def attributable(self, ours: int, sent_back: bool = False) -> bool:
        """Whether its waiting requests are the newest of this client's ``ours`` requests
        there (module docstring); ``sent_back``: the server may have decoding requests back
        in its queue (:class:`SentBack`)."""
        if self.waiting <= 0:
            return True  # nothing waits: none of ours either
        if self.queues_waiting > 1 or self.running + self.waiting > ours:
            return False
        return not sent_back


class SentBack:
    """The servers that may hold requests they sent back to their queue after decoding
    them: from a reading that shows a preemption (vLLM's counter moved) or a retraction
    (SGLang's ``queues.retracted``) until one shows the queue empty (a request sent back
    waits there until it runs again), as the gauges of one run are read."""

    def __init__(self) -> None:
        self.endpoints: set[str] = set()
        self._preemptions: dict[str, int | None] = {}  # the counter when none waited

    def update(self, queues: Mapping[str, ServerQueue]) -> None:
        for endpoint, queue in queues.items():
            before = self._preemptions.setdefault(endpoint, queue.preemptions)
            if queue.waiting <= 0:
                self.endpoints.discard(endpoint)
                self._preemptions[endpoint] = queue.preemptions
            elif queue.retracted or (
                None not in (before, queue.preemptions) and queue.preemptions != before
            ):
                self.endpoints.add(endpoint)


class QueueGauge(Protocol):
    route: str  # path under the server's root (not under /v1)

    def parse(self, text: str) -> ServerQueue | None: ...


class SGLangLoads:
    """SGLang's ``/v1/loads`` JSON, summed over data-parallel ranks."""

    route = "/v1/loads?include=core,queues"

    def parse(self, text: str) -> ServerQueue | None:
        try:
            loads = json.loads(text)["loads"]
            running = sum(int(load["num_running_reqs"]) for load in loads)
            waits = [int(load["num_waiting_reqs"]) for load in loads]
            retracted = sum(int((load.get("queues") or {}).get("retracted", 0)) for load in loads)
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
        return ServerQueue(
            running, sum(waits), sum(1 for w in waits if w > 0), retracted=retracted > 0
        )


# One sample line of the Prometheus text format: name, optional {labels}, value. Two gauges
# are all we read; a parser library (prometheus_client) would be a new pinned dependency
# for these two lines.
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)")


class VLLMMetrics:
    """vLLM's Prometheus ``/metrics``, summed over engines, and its preemption counter."""

    route = "/metrics"
    _GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    _PREEMPTIONS = "vllm:num_preemptions_total"

    def parse(self, text: str) -> ServerQueue | None:
        totals = dict.fromkeys(self._GAUGES, 0.0)
        seen = set()
        engines_waiting = 0
        preemptions: float | None = None
        for line in text.splitlines():
            match = _SAMPLE.match(line)
            if match is None or match["name"] not in (*self._GAUGES, self._PREEMPTIONS):
                continue
            try:
                value = float(match["value"])
            except ValueError:
                return None
            if match["name"] == self._PREEMPTIONS:
                preemptions = (preemptions or 0.0) + value
                continue
            totals[match["name"]] += value
            seen.add(match["name"])
            if match["name"] == "vllm:num_requests_waiting" and value > 0:
                engines_waiting += 1
        if len(seen) < len(totals):
            return None
        return ServerQueue(
            round(totals["vllm:num_requests_running"]),
            round(totals["vllm:num_requests_waiting"]),
            engines_waiting,
            None if preemptions is None else round(preemptions),
        )


def gauge_for(owned_by: Any) -> QueueGauge | None:
    """The queue gauge of a server, by its ``/models`` entry's ``owned_by``."""
    if owned_by == "sglang":
        return SGLangLoads()
    if owned_by == "vllm":
        return VLLMMetrics()
    return None


@dataclass(frozen=True)
class SentRequest:
    """One of this client's requests in flight: its conversation's position, where it went
    and when (None: not sent yet, waiting for a free slot of ours)."""

    pos: int
    endpoint: str | None
    sent_at: float | None


def queued_positions(
    requests: Iterable[SentRequest],
    queues: Mapping[str, ServerQueue],
    sent_back: Collection[str] = (),
) -> set[int]:
    """Positions whose request has not started decoding: not sent yet, or among the newest
    ``waiting`` of this client's requests on a server whose gauge can be read so
    (:meth:`ServerQueue.attributable`; ``sent_back``: the servers that may hold requests
    sent back to their queue, :attr:`SentBack.endpoints`). Requests to a server that
    reported nothing, or whose gauge cannot be attributed, count as started."""
    queued = set()
    by_endpoint: dict[str, list[SentRequest]] = {}
    for request in requests:
        if request.endpoint is None or request.sent_at is None:
            queued.add(request.pos)
        else:
            by_endpoint.setdefault(request.endpoint, []).append(request)
    for endpoint, sent in by_endpoint.items():
        queue = queues.get(endpoint)
        if queue is None or queue.waiting <= 0:
            continue
        if not queue.attributable(len(sent), endpoint in sent_back):
            continue
        sent.sort(key=lambda r: r.sent_at or 0.0)
        queued.update(r.pos for r in sent[-queue.waiting :])
    return queued
