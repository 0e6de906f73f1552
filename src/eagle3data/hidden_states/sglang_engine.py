"""SGLang's engine process side: how the capture engine and its worker processes are
started, signalled and logged.

:func:`start_engine` starts an ``sglang.Engine`` whose workers write to the job's log
(:func:`workers_write_to_job_log`), whose workers' failure fails the job with a line that
names the worker (:func:`worker_failed`), and which gives the job's signal handlers back
once it is up (:func:`keep_job_signal_handlers`); :func:`drop_messaging_contexts` lets a
job whose engine failed to start exit; :func:`job_log_path` is where the reaper writes.

sglang is imported only when an engine is started (the ``gpu`` extra installs it).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from ..errors import SGLangCaptureError
from ..servers.processes import EngineWatch


def start_engine(kwargs: Mapping[str, Any]) -> Any:
    """A real ``sglang.Engine`` (needs the ``gpu`` extra, and CUDA GPUs unless ``device``
    is ``cpu``), its workers writing to this job's log (:func:`workers_write_to_job_log`)
    and a worker's failure raised here (:func:`worker_failed`)."""
    if kwargs.get("device") == "cpu":
        # SGLang chooses its CPU platform from this variable alone (is_cpu()), at import,
        # in this process and the workers it spawns; device="cpu" without it dies in the
        # unknown-device path (seen with sglang 0.5.23).
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    try:
        import sglang
    except ImportError as exc:
        raise SGLangCaptureError(
            "hidden_states.backend is sglang but sglang is not installed; "
            "install the gpu extra: pip install -e '.[gpu]' -c constraints/gpu.txt"
        ) from exc
    with workers_write_to_job_log():
        engine = sglang.Engine(**{"custom_sigquit_handler": worker_failed, **kwargs})
    keep_job_signal_handlers(engine)
    return engine


def keep_job_signal_handlers(engine: Any) -> None:
    """Give SIGTERM and SIGQUIT back to the job once the engine is up.

    SGLang's tokenizer manager moves both into its asyncio loop on the engine's first
    request (``loop.add_signal_handler``, sglang 0.5.23), with handlers made for a server:
    SIGTERM then waits for the requests in flight and SIGKILLs the whole process tree, and
    a worker's failure (SIGQUIT) SIGKILLs it at once, this job included: the job died with
    no line in its log, its hand-off and SGLang's shared memory left behind (seen on
    SGLang's CPU engine: a rank that failed in the middle of a shard). So the loop is
    created now, its two handlers are removed, and the job's own (:func:`worker_failed`,
    the job's stop on SIGTERM) return.
    """
    manager = getattr(engine, "tokenizer_manager", None)
    loop = getattr(engine, "loop", None)
    if not hasattr(manager, "auto_create_handle_loop") or loop is None:
        return
    own = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGQUIT)}

    async def create_in_the_engines_loop() -> None:
        # Both inside the running loop: outside, the manager would make a loop of its own
        # that the engine never runs (every request then waits forever), and uvloop (the
        # engine's loop) removes a signal handler only while it runs (seen).
        manager.auto_create_handle_loop()
        for sig in own:
            loop.remove_signal_handler(sig)

    loop.run_until_complete(create_in_the_engines_loop())
    for sig, handler in own.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


# The engine's processes once it started, for worker_failed: a job runs one engine.
engine_watch: EngineWatch | None = None
# What worker_failed found, for a failure inside the engine's event loop (see there).
worker_failure: str | None = None
# The job's processes before its engine started (SGLangCapture sets it), for worker_failed.
before_engine: set[tuple[int, int]] = set()


def worker_failed(_signum: int, _frame: Any) -> None:
    """SIGQUIT handler of the engine's process (``custom_sigquit_handler``, and again
    once the engine runs: :func:`keep_job_signal_handlers`).

    SGLang's workers, and its watchdog of them, send SIGQUIT to the engine's process when
    a worker fails or dies, and SGLang's own handler then SIGKILLs the whole process tree,
    this job included: the job died with no line in its log (seen with sglang 0.5.23).
    This one names the worker that ended and how (:class:`EngineWatch`), stops the other
    workers the same way, and fails the job with that line. Later SIGQUITs of the same
    collapse (every rank notices) are ignored.

    Inside a request the engine's event loop (uvloop) runs Python's signal handlers and
    logs whatever they raise, but a KeyboardInterrupt, instead of raising it: there the
    handler stops the loop, ``Engine.generate`` raises, and
    :meth:`.sglang_capture.SGLangCapture.forward` raises the failure in its place."""
    from sglang.srt.utils import kill_process_tree

    global worker_failure
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)
    watch = engine_watch or EngineWatch(before_engine)
    worker_failure = (
        f"{watch.failure()}; the capture stopped, this shard's partial file is discarded, "
        f"and the same command redoes the shard"
    )
    kill_process_tree(os.getpid(), include_parent=False)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise SGLangCaptureError(worker_failure) from None
    loop.stop()


@contextlib.contextmanager
def workers_write_to_job_log() -> Iterator[None]:
    """Keep this job's log through an engine start (sglang 0.5.23 facts):

    * stderr, which the engine's worker processes inherit when they start, points at the
      job's log file for the duration of the block (this process gets its own back): the
      scheduler and detokenizer log to stderr, which for a Snakemake job is the console of
      the whole run, and a worker's traceback was lost there;
    * the root logger's handlers and level are put back afterwards: the engine reconfigures
      logging (``basicConfig(force=True)``), which dropped the job's log file, so no later
      line of the job reached it."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    logs = [h for h in handlers if isinstance(h, logging.FileHandler)]
    saved = None
    try:
        if logs:
            sys.stderr.flush()
            saved = os.dup(2)
            with open(logs[0].baseFilename, "ab", buffering=0) as job_log:
                os.dup2(job_log.fileno(), 2)
        yield
    finally:
        if saved is not None:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        root.handlers[:] = handlers
        root.setLevel(level)


def drop_messaging_contexts() -> None:
    """Close every ZeroMQ context of this process without lingering.

    An ``sglang.Engine`` whose scheduler dies while it starts raises, but leaves its ZeroMQ
    contexts (``zmq.Context(2)`` in the engine and its tokenizer manager) holding messages for
    processes that never connected. Their sockets linger forever by default, so the
    interpreter's exit blocks in ``Context.term()`` and the job hangs instead of failing
    (seen with sglang 0.5.23: a scheduler that died at import kept the job alive until
    killed). SGLang keeps no handle to them, hence the search of the heap; only a failed
    start calls this, when nothing else in the job uses ZeroMQ.
    """
    zmq = sys.modules.get("zmq")
    if zmq is None:
        return
    for obj in gc.get_objects():
        if isinstance(obj, zmq.Context) and not obj.closed:
            obj.destroy(linger=0)


def job_log_path() -> str | None:
    """The job's log file (run_step's file handler), where the reaper writes its line."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return handler.baseFilename
    return None
