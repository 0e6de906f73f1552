"""Who is at work on a file now: a run file beside it, kept fresh by a heartbeat.

A process that works on a file (a generation journal, a job's log) records itself in
``<file stem>.run.json`` (host, pid, start; the end once it is done) and touches that
record every :data:`HEARTBEAT_S` while it lives. The status command reads these to tell
a running job from a stopped one without touching any lock: on this host by the pid, on
a shared filesystem (SLURM nodes) by the heartbeat. A killed process records no end.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from .atomic import HOST, pid_alive, write_json

HEARTBEAT_S = 30.0  # how often a live process touches its run file
STALE_AFTER_S = 3 * HEARTBEAT_S  # a run file untouched this long: its process is gone


def run_file(path: Path) -> Path:
    return path.with_suffix(".run.json")


@dataclass(frozen=True)
class Run:
    """The latest process at work on a file, as its run file says."""

    host: str
    pid: int
    started_at: float  # unix seconds
    ended_at: float | None  # when it was done; None while at work or if killed
    heartbeat_at: float  # the run file's mtime

    def running(self, now: float) -> bool:
        """Whether the process is still at work. A killed one leaves no end: on this
        host its pid is gone; elsewhere its heartbeat stops."""
        if self.ended_at is not None or now - self.heartbeat_at > STALE_AFTER_S:
            return False
        return self.host != HOST or pid_alive(self.pid)


def read_run(path: Path) -> Run | None:
    """The latest process at work on ``path``, or None (none recorded)."""
    return _read_run_file(run_file(path))


def runs_in(directory: Path, pattern: str = "*") -> list[Run]:
    """The latest process of each file in ``directory`` whose stem matches ``pattern``."""
    return [r for p in sorted(directory.glob(f"{pattern}.run.json")) if (r := _read_run_file(p))]


def _read_run_file(path: Path) -> Run | None:
    try:
        info = json.loads(path.read_text())
        return Run(
            str(info["host"]),
            int(info["pid"]),
            float(info["started_at"]),
            None if info.get("ended_at") is None else float(info["ended_at"]),
            path.stat().st_mtime,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


class Heartbeat:
    """Records this process as at work on ``path`` and touches the record until stopped."""

    def __init__(self, path: Path) -> None:
        self.path = run_file(path)
        self.info = {"host": HOST, "pid": os.getpid(), "started_at": round(time.time(), 3)}
        write_json(self.path, self.info)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):  # a hiccup of a shared filesystem
                os.utime(self.path)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            write_json(self.path, {**self.info, "ended_at": round(time.time(), 3)})

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
