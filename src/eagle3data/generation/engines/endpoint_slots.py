"""Requests in flight to one server, shared by every generate job of a run.

``generation.concurrency`` is what one endpoint gets from the whole run, not from each
job: the datasets' generate jobs run at once (they wait on servers, not on cores), and
each sends as many requests as the others leave room for. So a dataset in its tail, with
few requests left to send, leaves its part of the server to the datasets still in bulk,
and nine datasets against one server keep ``concurrency`` requests in flight, not nine
times that.

How: each endpoint has ``concurrency`` slot files in a folder of its own
(``results/.work/endpoint-slots/<hash of the URL>/slot-NNNN.lock``, its URL in
``endpoint.txt``; ``EAGLE3DATA_ENDPOINT_SLOT_DIR`` moves the parent folder), and a request
holds an exclusive ``flock`` on one from before it is sent until its answer is read. The
kernel drops a flock when its holder dies, however it dies (SIGKILL included), so a killed
job never leaks a slot, and nothing needs cleaning after it. Slots live on the results
filesystem, as the journals' locks do, so jobs on several SLURM nodes share them too
(flock works on Lustre and recent NFS, though each lock is then a round trip).

Sharing is fair when it has to be: each job holds an exclusive flock on its own
``jobs/<pid>-<hex>.job`` file while it lives (the others count the live jobs by them), and
on its ``.wants`` file while it has requests it cannot send and holds fewer slots than its
share (``concurrency // jobs``, at least 1). While another job wants, a job that holds its
share takes no slot, not even the one its own request just freed: that one goes to the job
that wants. Otherwise any job takes any free slot, so no slot idles while some job has
something to send.

Jobs that name one server by different URLs (``localhost`` and ``127.0.0.1``) do not share.
Jobs configured with different concurrencies use the first ``concurrency`` slots each: the
server never sees more than the largest.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import random
import resource
import time
import uuid
from collections import deque
from pathlib import Path

from ...layout import ENDPOINT_SLOTS, Results

log = logging.getLogger(__name__)

SLOT_DIR_ENV = "EAGLE3DATA_ENDPOINT_SLOT_DIR"
# How stale this job's view of the other jobs (how many, which want) may be; also how often
# a job with requests it cannot send looks for a free slot again.
SLOT_POLL_S = 0.05


def slot_root(results: Results | None = None) -> Path:
    """Where the run's endpoint slot folders are: ``$EAGLE3DATA_ENDPOINT_SLOT_DIR``, else
    ``results/.work/endpoint-slots`` of the workflow directory."""
    override = os.environ.get(SLOT_DIR_ENV)
    if override:
        return Path(override)
    return (results or Results()).path(ENDPOINT_SLOTS)


def endpoint_key(url: str) -> str:
    """The folder name of an endpoint's slots: a hash of its URL (without a trailing /)."""
    return hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]


def _try_flock(fd: int, operation: int) -> bool:
    """``flock(fd, operation | LOCK_NB)``: False when someone else holds a conflicting lock."""
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _locked_by_another(path: Path) -> bool | None:
    """Whether another open file holds an exclusive lock on ``path`` (None: no such file)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        return not _try_flock(fd, fcntl.LOCK_SH)
    finally:
        os.close(fd)  # drops the probe's own shared lock, if it got one


def allow_open_files(requests: int) -> None:
    """Raise this process's soft limit on open files where the hard limit allows, for
    ``requests`` in flight: each holds a socket and a slot file."""
    needed = 2 * requests + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < needed:
        log.warning(
            "open files are limited to %d (hard limit); %d requests in flight need about %d: "
            "raise `ulimit -n` or lower generation.concurrency",
            target,
            requests,
            needed,
        )


class EndpointSlots:
    """This job's view of one endpoint's ``count`` shared slots: :meth:`take` one for a
    request, :meth:`give` it back after, :meth:`want` while requests wait for one."""

    def __init__(self, root: Path, url: str, count: int) -> None:
        if count < 1:
            raise ValueError(f"an endpoint needs at least one slot, got {count}")
        self.url = url.rstrip("/")
        self.count = count
        self.directory = Path(root) / endpoint_key(self.url)
        self._jobs = self.directory / "jobs"
        self._jobs.mkdir(parents=True, exist_ok=True)
        note = self.directory / "endpoint.txt"
        if not note.exists():
            note.write_text(self.url + "\n", encoding="utf-8")
        self._held: dict[int, int] = {}  # slot -> the open file that holds its lock
        self._freed: deque[int] = deque(maxlen=16)  # given back lately: likely still free
        self._dry_until = -float("inf")  # no slot was free at the last look until then
        self._rng = random.Random()
        self._wanting = False
        self._name, self._job_fd, self._wants_fd = self._join()
        self._seen_at = -float("inf")
        self._live_jobs = 1
        self._others_want = False

    @property
    def held(self) -> int:
        """Slots this job holds now."""
        return len(self._held)

    def share(self) -> int:
        """This job's fair share: the slots divided among the live jobs, at least one."""
        self._look()
        return max(1, self.count // self._live_jobs)

    def take(self) -> int | None:
        """Lock a free slot for one request; None when none is free, or when this job holds
        its share and another job wants."""
        if len(self._held) >= self.share() and self._others_want:
            return None
        if not self._freed and time.monotonic() < self._dry_until:
            return None  # none was free a moment ago: look again at the next poll
        start = self._rng.randrange(self.count)
        order = [*reversed(self._freed), *((start + i) % self.count for i in range(self.count))]
        self._freed.clear()
        for slot in order:
            if slot in self._held:
                continue
            fd = os.open(self.directory / f"slot-{slot:04d}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            if _try_flock(fd, fcntl.LOCK_EX):
                self._held[slot] = fd
                return slot
            os.close(fd)
        # Every request waiting in this job would find the same: one look per poll.
        self._dry_until = time.monotonic() + SLOT_POLL_S
        return None

    def give(self, slot: int) -> None:
        """Free a slot this job took (the next :meth:`take` tries it first)."""
        fd = self._held.pop(slot)
        os.close(fd)  # closing the only descriptor drops the flock
        self._freed.append(slot)

    def want(self, waiting: bool) -> None:
        """Say whether this job has requests it cannot send now: while it does and holds
        fewer slots than its share, the jobs holding theirs leave free slots to it."""
        wanting = waiting and len(self._held) < self.share()
        if wanting == self._wanting:
            return
        fcntl.flock(self._wants_fd, fcntl.LOCK_EX if wanting else fcntl.LOCK_UN)
        self._wanting = wanting

    def close(self) -> None:
        """Free every slot and leave the endpoint's jobs."""
        for slot in list(self._held):
            self.give(slot)
        if self._job_fd < 0:
            return
        for suffix in (".job", ".wants"):
            (self._jobs / f"{self._name}{suffix}").unlink(missing_ok=True)
        os.close(self._wants_fd)
        os.close(self._job_fd)
        self._job_fd = self._wants_fd = -1

    def _join(self) -> tuple[str, int, int]:
        """Become one of the endpoint's jobs: the ``.job`` file appears already locked (made
        under another name, then renamed), so no other job ever takes it for a dead one's."""
        name = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        wants_fd = os.open(self._jobs / f"{name}.wants", os.O_RDWR | os.O_CREAT, 0o644)
        making = self._jobs / f".{name}.tmp"
        job_fd = os.open(making, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(job_fd, fcntl.LOCK_EX)
        os.rename(making, self._jobs / f"{name}.job")
        return name, job_fd, wants_fd

    def _look(self) -> None:
        """Count the live jobs and whether another one wants, at most every SLOT_POLL_S;
        remove the files of dead jobs."""
        now = time.monotonic()
        if now - self._seen_at < SLOT_POLL_S:
            return
        self._seen_at = now
        live, want = 1, False
        for job in self._jobs.glob("*.job"):
            name = job.name.removesuffix(".job")
            if name == self._name:
                continue
            alive = _locked_by_another(job)
            if alive is None:
                continue  # left meanwhile
            if not alive:  # died: the kernel dropped its lock
                job.unlink(missing_ok=True)
                (self._jobs / f"{name}.wants").unlink(missing_ok=True)
                continue
            live += 1
            want = want or bool(_locked_by_another(self._jobs / f"{name}.wants"))
        self._live_jobs, self._others_want = live, want
