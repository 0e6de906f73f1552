"""Make SIGTERM safe for the Snakemake driver.

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
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
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
