"""Signals: SIGTERM made safe for the Snakemake driver, and a clean stop for its jobs.

**The driver.**

Snakemake's scheduler (checked on 9.27.1) installs ``JobScheduler.exit_gracefully``
as the driver's SIGTERM handler, and that handler takes the scheduler's
non-reentrant ``threading.Lock``. Python runs signal handlers in the main thread,
in between the bytecodes of whatever it was doing; the main thread holds that lock
while it selects and finishes jobs, so a SIGTERM landing then (``scancel``,
``timeout``, a pod stop, the chaos tests) makes the handler wait for a lock its own
thread holds: the driver hangs forever. Measured: a workflow of 400 tiny jobs hung
on 15 of 15 SIGTERMs, each stack ending in ``exit_gracefully`` above the ILP job
selector.

:func:`relay_sigterm_off_main_thread` keeps Snakemake's behaviour (no new jobs,
exit once the running ones end) but moves the handler to a helper thread, where
waiting for the lock is harmless: the new main-thread handler only writes a byte
to a pipe, which takes no Python lock. No library does this for us; it is called
from the workflow's ``onstart`` hook, after Snakemake has installed its handler.

**The jobs.** Ctrl-C sends SIGINT, ``kill``, ``scancel`` and a pod stop send SIGTERM, to
every process of the run. By default a job then dies with a long ``KeyboardInterrupt``
traceback from wherever it was (often deep inside torch), or silently for SIGTERM.
:func:`stop_on_signals` (installed by :func:`eagle3data.jobs.run_step`) turns the first of
either into :class:`StopSignal` in the job's main thread, so the job unwinds (locks and
journals closed, temporaries removed) and says in one line what it kept.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType


def relay_sigterm_off_main_thread() -> bool:
    """Run the current Python-level SIGTERM handler in a helper thread instead of
    the main thread. Returns False (and changes nothing) when there is no Python
    handler to relay, or when called outside the main thread."""
    handler = signal.getsignal(signal.SIGTERM)
    if not callable(handler) or threading.current_thread() is not threading.main_thread():
        return False
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # a burst of signals must never block the handler

    def relay() -> None:
        while os.read(read_fd, 1):
            handler(signal.SIGTERM, None)

    def wake_relay(signum: int, frame: FrameType | None) -> None:
        # A full pipe means the relay has SIGTERMs enough to act on.
        with contextlib.suppress(BlockingIOError):
            os.write(write_fd, b"\0")

    threading.Thread(target=relay, name="sigterm-relay", daemon=True).start()
    signal.signal(signal.SIGTERM, wake_relay)
    return True


class StopSignal(KeyboardInterrupt):
    """SIGINT or SIGTERM asked this job to stop (a KeyboardInterrupt, so code that
    already handles Ctrl-C handles both)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def stop_on_signals() -> None:
    """Raise :class:`StopSignal` in the main thread on the first SIGINT or SIGTERM, and
    ignore both from then on, so a second signal cannot cut the cleanup short (SIGKILL
    still can). Call it from the main thread."""

    def stop(signum: int, frame: FrameType | None) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        if _deferred.depth:
            _deferred.pending = signum
            return
        raise StopSignal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)


class _Deferred:
    depth = 0
    pending: int | None = None


_deferred = _Deferred()


@contextlib.contextmanager
def stop_deferred() -> Iterator[None]:
    """Hold a :func:`stop_on_signals` stop until the block has run: the block is one step
    that must happen whole (a journal append and the counts that say what it holds).

    A signal mask cannot do this: the kernel hands a process-directed signal to any
    thread that does not block it (torch's and OpenMP's do not), and Python then runs
    the handler in the main thread wherever it is.
    """
    _deferred.depth += 1
    try:
        yield
    finally:
        _deferred.depth -= 1
    if not _deferred.depth and _deferred.pending is not None:
        signum, _deferred.pending = _deferred.pending, None
        raise StopSignal(signum)


def signal_name(stop: KeyboardInterrupt) -> str:
    """Which signal a KeyboardInterrupt stands for (a plain one is Python's SIGINT)."""
    return signal.Signals(stop.signum).name if isinstance(stop, StopSignal) else "SIGINT"
