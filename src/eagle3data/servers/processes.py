"""The worker processes of an in-process SGLang engine, seen from the job that started it.

An ``sglang.Engine`` runs its schedulers (one per rank), its detokenizer and, with
data parallelism, a controller as processes below the job. When one of them dies, SGLang
only learns that "a child failed" (a SIGQUIT); this module says which one and how: the
rank SGLang titled it with (``sglang::scheduler_TP1_EP1``) and its end (killed by a
signal, an exit code, or ended after logging its traceback). It also lists the shared
memory those processes hold in ``/dev/shm``, which SGLang leaves behind when its workers
are killed (:mod:`.reaper` removes it).

Linux only (``/proc``), as SGLang is. Written by hand: psutil (an SGLang dependency, not
ours) gives the tree, but not the exit status of a dead grandchild nor the mapped files
in one call, and the reaper must not import anything heavy.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass

from .reaper import PROC, stat_fields

SHM = "/dev/shm/"


@dataclass(frozen=True)
class Worker:
    """One process of the engine: its pid, when it started (clock ticks since boot, which
    tells a reused pid apart) and SGLang's title for it."""

    pid: int
    started: int
    title: str

    @property
    def name(self) -> str:
        """``scheduler TP1 EP1``, ``detokenizer``, or the command for an untitled one."""
        if not self.title.startswith("sglang::"):
            return self.title[:80] or f"pid {self.pid}"
        return self.title.split("::", 1)[1].replace("_", " ")


@dataclass(frozen=True)
class _Stat:
    state: str
    ppid: int
    started: int
    exit_status: int


def _stat(pid: int) -> _Stat | None:
    """Fields of ``/proc/<pid>/stat``; None once the process is gone."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    exit_status = int(fields[52 - 3]) if len(fields) > 52 - 3 else 0
    return _Stat(fields[0], int(fields[1]), int(fields[22 - 3]), exit_status)


def _title(pid: int) -> str:
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return ""
    parts = [p.decode(errors="replace") for p in raw.split(b"\0") if p]
    return " ".join(parts)


def descendants(root: int) -> list[Worker]:
    """Every live process below ``root``, parents before children."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None:
                children.setdefault(stat.ppid, []).append(int(entry.name))
    found: list[Worker] = []
    queue = sorted(children.get(root, []))
    while queue:
        pid = queue.pop(0)
        stat = _stat(pid)
        if stat is None:
            continue
        found.append(Worker(pid, stat.started, _title(pid)))
        queue.extend(sorted(children.get(pid, [])))
    return found


def is_running(worker: Worker) -> bool:
    """Alive and not a zombie (the same process: its start time matches)."""
    stat = _stat(worker.pid)
    return stat is not None and stat.started == worker.started and stat.state != "Z"


def shm_files(pids: Iterable[int]) -> set[str]:
    """Files in ``/dev/shm`` that these processes map or hold open (named shared-memory
    segments, POSIX semaphores, the hand-off's rows).

    Matched by inode, not by the name in ``maps``: glibc creates a semaphore under a
    temporary name, maps it, then links it to its real name (``sem.mp-*``) and removes the
    temporary one, so ``maps`` shows a name that no longer exists."""
    inodes: set[int] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in (PROC / str(pid) / "maps").read_text().splitlines():
                # address perms offset dev inode path (the path may hold spaces)
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith(SHM):
                    inodes.add(int(parts[4]))
        with contextlib.suppress(OSError):
            for fd in (PROC / str(pid) / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd).startswith(SHM):
                        inodes.add(os.stat(fd).st_ino)
    found: set[str] = set()
    with contextlib.suppress(OSError), os.scandir(SHM) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.is_file(follow_symlinks=False) and entry.inode() in inodes:
                    found.add(entry.path)
    return found


def signal_name(number: int) -> str:
    """``SIGKILL``; real-time signals, which have no name in :class:`signal.Signals`, as
    ``SIGRTMIN+3``; anything else as ``signal 99``."""
    try:
        return signal.Signals(number).name
    except ValueError:
        if signal.SIGRTMIN <= number <= signal.SIGRTMAX:
            return f"SIGRTMIN+{number - signal.SIGRTMIN}"
        return f"signal {number}"


def describe_end(status: int) -> str:
    """A wait status (``/proc/<pid>/stat`` field 52, or ``os.waitpid``) in words."""
    if os.WIFSIGNALED(status):
        return f"was killed by {signal_name(os.WTERMSIG(status))}"
    code = os.WEXITSTATUS(status)
    # A scheduler that hits an exception logs it, signals the job and returns: exit 0.
    return "ended after an error" if code == 0 else f"exited with code {code}"


def process_keys(workers: Iterable[Worker]) -> set[tuple[int, int]]:
    return {(w.pid, w.started) for w in workers}


class EngineWatch:
    """The engine's processes (this process's descendants, but for those in ``before``,
    which were there before the engine started), to tell later which ended and how."""

    def __init__(self, before: set[tuple[int, int]] | None = None) -> None:
        self.before = before or set()
        self.workers: list[Worker] = []
        # The job's own children as multiprocessing objects: SGLang's watchdog reaps a
        # dead scheduler through the same object, which keeps its exit code.
        self._processes: dict[int, multiprocessing.process.BaseProcess] = {}
        self.refresh()

    def refresh(self) -> None:
        """Add the engine's processes started since the last look."""
        known = process_keys(self.workers) | self.before
        self.workers += [w for w in descendants(os.getpid()) if (w.pid, w.started) not in known]
        for process in multiprocessing.active_children():
            if process.pid is not None:
                self._processes.setdefault(process.pid, process)

    def running_pids(self) -> list[int]:
        return [w.pid for w in self.workers if is_running(w)]

    def end_of(self, worker: Worker) -> str | None:
        """How ``worker`` ended, or None while it runs."""
        process = self._processes.get(worker.pid)
        if process is not None:
            code = process.exitcode
            if code is None:
                return None
            if code < 0:
                return f"was killed by {signal_name(-code)}"
            return describe_end(code << 8)
        stat = _stat(worker.pid)
        if stat is not None and stat.started == worker.started:
            return describe_end(stat.exit_status) if stat.state == "Z" else None
        return "ended"

    def ended(self) -> list[tuple[Worker, str]]:
        return [(w, end) for w in self.workers if (end := self.end_of(w)) is not None]

    def failure(self, wait_s: float = 10.0) -> str:
        """One line naming the worker(s) whose end stopped the engine. A worker that hit
        an exception signals the job first and exits just after: wait a little for it
        (10 s: on a loaded 2-core machine a failed scheduler took more than 3 s to exit)."""
        deadline = time.monotonic() + wait_s
        ended = self.ended()
        while not ended and time.monotonic() < deadline:
            time.sleep(0.1)
            self.refresh()
            ended = self.ended()
        if not ended:
            return "an SGLang worker process failed (its traceback is above in this job's log)"
        # A rank killed by a signal is the cause; the ranks that then failed in a
        # collective with it are its consequence.
        killed = [(w, e) for w, e in ended if e.startswith("was killed")]
        chosen = killed or ended
        named = ", ".join(f"{w.name} (pid {w.pid}) {end}" for w, end in chosen)
        where = "" if killed else " (its traceback is above in this job's log)"
        return f"SGLang worker {named}{where}"
