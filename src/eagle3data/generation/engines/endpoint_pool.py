"""Where an HTTP engine's requests go: fewest-in-flight among its endpoints that are not
paused, each endpoint's ``concurrency`` this engine's own or shared with the run's other
generate jobs (:mod:`.endpoint_slots`); an endpoint that keeps failing is paused."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ...servers.queue import QueueGauge
from .endpoint_slots import SLOT_POLL_S, EndpointSlots, allow_open_files

log = logging.getLogger(__name__)


@dataclass
class Endpoint:
    url: str
    in_flight: int = 0
    consecutive_failures: int = 0
    paused_until: float = 0.0
    max_model_len: int | None = None  # its /models entry's, when it reports one
    token_ids: bool = True  # False once it refused return_token_ids or sent odd ids
    abortable: bool = False  # SGLang: requests carry a rid and are aborted by it
    queue_gauge: QueueGauge | None = None  # where it reports its running and waiting requests
    slots: EndpointSlots | None = None  # shared with the run's other jobs, when they are
    # Held from a request's send until its body is written (``openai_engine._InOrder``).
    send_order: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass
class Lease:
    """Room for one request on one endpoint: a place in this engine's ``concurrency`` and,
    where the endpoint's slots are shared, the slot it holds (:mod:`.endpoint_slots`)."""

    endpoint: Endpoint
    slot: int | None = None


class EndpointPool:
    """Fewest-in-flight choice among endpoints that are not paused.

    With ``slot_dir`` (:meth:`open_slots`), each endpoint's ``concurrency`` is shared with
    the other jobs of the run: a request also needs one of its slots, which it holds until
    its answer is read."""

    def __init__(
        self,
        urls: Sequence[str],
        concurrency: int,
        max_failures: int,
        pause_s: float,
        slot_dir: str | None = None,
    ):
        self.endpoints = [Endpoint(u.rstrip("/")) for u in urls]
        self.concurrency = concurrency
        self.max_failures = max_failures
        self.pause_s = pause_s
        self.slot_dir = slot_dir
        self._changed = asyncio.Condition()
        self._waiting = 0  # requests waiting in acquire()
        self._unsent = 0  # what the last take() could not give

    @property
    def capacity(self) -> int:
        return self.concurrency * len(self.endpoints)

    @property
    def shared(self) -> bool:
        """Whether the endpoints' slots are shared with the run's other jobs."""
        return self.slot_dir is not None

    def open_slots(self) -> None:
        """Join each endpoint's shared slots (nothing without ``slot_dir``)."""
        if self.slot_dir is None:
            return
        allow_open_files(self.capacity)
        for endpoint in self.endpoints:
            endpoint.slots = EndpointSlots(Path(self.slot_dir), endpoint.url, self.concurrency)
            log.info(
                "%s: its %d requests in flight are shared with the run's other generate jobs "
                "(slots in %s)",
                endpoint.url,
                self.concurrency,
                endpoint.slots.directory,
            )

    def close_slots(self) -> None:
        for endpoint in self.endpoints:
            if endpoint.slots is not None:
                endpoint.slots.close()
                endpoint.slots = None

    def _available(self) -> list[Endpoint]:
        now = time.monotonic()
        return [
            e for e in self.endpoints if e.paused_until <= now and e.in_flight < self.concurrency
        ]

    def _lease_now(self) -> Lease | None:
        """Room for a request now on the least busy endpoint that has some, or None."""
        for endpoint in sorted(self._available(), key=lambda e: e.in_flight):
            slot = None
            if endpoint.slots is not None:
                slot = endpoint.slots.take()
                if slot is None:
                    continue
            endpoint.in_flight += 1
            return Lease(endpoint, slot)
        return None

    def _say_wanted(self) -> None:
        """Tell the other jobs whether requests of ours wait for a slot."""
        waiting = self._waiting + self._unsent > 0
        for endpoint in self.endpoints:
            if endpoint.slots is not None:
                endpoint.slots.want(waiting)

    def take(self, n: int) -> list[Lease]:
        """Room for up to ``n`` requests now, without waiting (the driver sends that many
        new conversations); what it could not give counts as wanted until the next call."""
        leases = []
        while len(leases) < n and (lease := self._lease_now()) is not None:
            leases.append(lease)
        self._unsent = n - len(leases)
        self._say_wanted()
        return leases

    async def acquire(self) -> Lease:
        async with self._changed:
            self._waiting += 1
            try:
                while True:
                    lease = self._lease_now()
                    if lease is not None:
                        return lease
                    self._say_wanted()
                    # Wake on a release, when the earliest pause ends, or (shared slots,
                    # freed by other processes) at the next look.
                    now = time.monotonic()
                    pauses = [e.paused_until - now for e in self.endpoints if e.paused_until > now]
                    if self.shared:
                        pauses.append(SLOT_POLL_S)
                    timeout = max(min(pauses), 0.01) if pauses else None
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), timeout)
            finally:
                self._waiting -= 1
                self._say_wanted()

    def give_back(self, lease: Lease) -> None:
        """Free room no request used (a conversation cancelled before it sent anything).
        Only leases of :meth:`take` come back this way: where they exist, requests waiting
        in :meth:`acquire` look again at the next poll."""
        endpoint = lease.endpoint
        endpoint.in_flight -= 1
        if lease.slot is not None and endpoint.slots is not None:
            endpoint.slots.give(lease.slot)
            self._say_wanted()

    async def release(self, lease: Lease, *, healthy: bool | None) -> None:
        """``healthy`` None: the request ended without telling anything about the server."""
        async with self._changed:
            endpoint = lease.endpoint
            self.give_back(lease)
            if healthy:
                endpoint.consecutive_failures = 0
            elif healthy is False:
                endpoint.consecutive_failures += 1
                if endpoint.consecutive_failures >= self.max_failures:
                    endpoint.paused_until = time.monotonic() + self.pause_s
                    endpoint.consecutive_failures = 0
                    log.warning(
                        "endpoint %s failed %d times in a row: paused for %.0fs",
                        endpoint.url,
                        self.max_failures,
                        self.pause_s,
                    )
            self._changed.notify_all()
