"""SIGTERM must stop the Snakemake driver, whatever its main thread holds at that moment.

Snakemake's own SIGTERM handler takes a non-reentrant lock that its main thread holds
while it selects jobs, so the driver deadlocks; ``driver_signals`` relays the handler
to a helper thread. These tests reproduce the deadlock itself (a handler that takes a
lock held by the interrupted main thread), in a plain Python process (the
driver itself: tests/workflow/test_driver_sigterm.py), and show that the relay removes it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from support.workflow import REPO

SRC = str(REPO / "src")

# A process whose SIGTERM handler takes a lock that the main thread holds when the
# signal lands, as Snakemake's scheduler does; prints where the handler ran.
LOCK_HELD_AT_SIGTERM = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    sys.path.insert(0, {src!r})
    from eagle3data.driver_signals import relay_sigterm_off_main_thread

    lock = threading.Lock()
    ran_in = []

    def exit_gracefully(signum, frame):
        with lock:
            ran_in.append(threading.current_thread().name)

    signal.signal(signal.SIGTERM, exit_gracefully)
    if {relay!r}:
        assert relay_sigterm_off_main_thread()
    with lock:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)  # the main thread keeps the lock while the signal is handled
    deadline = time.monotonic() + 10
    while not ran_in and time.monotonic() < deadline:
        time.sleep(0.01)
    print(ran_in)
    """
)


@pytest.mark.parametrize("relay", [False, True])
def test_a_handler_taking_a_lock_held_by_the_main_thread(relay: bool) -> None:
    code = LOCK_HELD_AT_SIGTERM.format(src=SRC, relay=relay)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        # The script ends in about a second unless it deadlocks; the deadlock it looks for
        # is for ever, so the run without the relay waits less for it.
        out, _ = proc.communicate(timeout=20 if relay else 8)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        assert not relay, "the relayed handler deadlocked"
        return  # without the relay: the deadlock this module exists for
    assert relay, "expected the unrelayed handler to deadlock"
    assert proc.returncode == 0
    assert out.strip() == "['sigterm-relay']"


def test_nothing_to_relay_changes_nothing() -> None:
    code = textwrap.dedent(
        f"""
        import signal, sys
        sys.path.insert(0, {SRC!r})
        from eagle3data.driver_signals import relay_sigterm_off_main_thread
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert relay_sigterm_off_main_thread() is False
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


def test_a_burst_of_sigterms_never_blocks_the_main_thread() -> None:
    """More signals than the pipe holds: the handler drops extra wake-ups."""
    code = textwrap.dedent(
        f"""
        import os, signal, sys, threading
        sys.path.insert(0, {SRC!r})
        from eagle3data.driver_signals import relay_sigterm_off_main_thread
        gate = threading.Event()
        calls = []
        def handler(signum, frame):
            gate.wait()
            calls.append(signum)
        signal.signal(signal.SIGTERM, handler)
        relay_sigterm_off_main_thread()
        for _ in range(100_000):  # the relay is stuck in the first call meanwhile
            os.kill(os.getpid(), signal.SIGTERM)
        gate.set()
        print("main thread free")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, timeout=120, capture_output=True, text=True
    )
    assert out.stdout.strip() == "main thread free"
