"""Cleans up after an SGLang engine when the job that ran it ends, however it ends.

What an engine leaves when its processes are killed (seen with sglang 0.5.23 on CPU, one
set per engine, after a normal shutdown as well: SGLang tears its workers down with
SIGKILL, multiprocessing's resource tracker included): a ``sgl_shm_mq_*`` segment of
24 MiB, a ``sglang_loads_*`` file, two ``sem.mp-*`` semaphores, and our hand-off directory
when the job itself was killed. A days-long run starts an engine per shard job, so these
add up in ``/dev/shm`` (a tmpfs: memory) until a worker dies of SIGBUS. SGLang's own sweep
(``stale_shm_cleanup``) runs only in its CI and deletes by name prefix, which would also
hit another engine's live files.

So every capture job starts this reaper first, outside its own process tree (SGLang's
shutdown SIGKILLs the job's whole tree) and in its own session (a ``kill`` of the job's
process group must not reach it). The job tells it, as JSON lines on its stdin, which
processes the engine runs and which ``/dev/shm`` files those processes hold (seen in
``/proc``, :mod:`.processes`), so only the engine's own files are ever removed. When
the stdin closes (the job closed it after a normal shutdown, or the kernel did because
the job died, even by ``kill -9``), it kills whatever engine process is left, removes the
files and directories, writes one line to the job's log and answers ``done`` on stdout.

Standard library only, run by path (``python reaper.py``): it must start in
milliseconds and work where the package is not installed (Snakemake scripts put ``src``
on ``sys.path`` themselves).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

PROC = Path("/proc")
# How long killed workers get to disappear before their files are removed anyway.
KILL_WAIT_S = 10.0


def stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` (proc(5)) after the command, so that field N is ``[N - 3]``
    (the command, field 2, is in parentheses and may hold spaces); None once gone."""
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()


def _started(pid: int) -> int | None:
    """Field 22 (start time), None once the pid is gone or a zombie."""
    fields = stat_fields(pid)
    return None if fields is None or fields[0] == "Z" else int(fields[22 - 3])


def kill_workers(workers: Iterable[tuple[int, int]]) -> int:
    """SIGKILL each (pid, start time) still running; wait until they are gone. Returns
    how many were killed."""
    alive = [pid for pid, started in workers if _started(pid) == started]
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + KILL_WAIT_S
    while time.monotonic() < deadline and any(_started(pid) is not None for pid in alive):
        time.sleep(0.05)
    return len(alive)


def remove_files(paths: Iterable[str]) -> tuple[int, int]:
    """Unlink each path that still exists; (files removed, bytes freed)."""
    removed = freed = 0
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            size = os.stat(path).st_size
            os.unlink(path)
            removed += 1
            freed += size
    return removed, freed


def clean(state: dict[str, Any]) -> str:
    """Kill, unlink, remove; what was done, in words."""
    killed = kill_workers(tuple(w) for w in state["workers"])
    removed, freed = remove_files(state["files"])
    dirs = 0
    for directory in state["dirs"]:
        if Path(directory).exists():
            shutil.rmtree(directory, ignore_errors=True)
            dirs += 1
    return (
        f"SGLang engine cleaned up: {killed} worker process(es) killed, {removed} shared-memory "
        f"file(s) removed ({freed / 2**20:,.1f} MiB), {dirs} hand-off director(ies) removed"
    )


def serve(lines: IO[str], answer: IO[str], log: Path | None) -> None:
    """Collect what the job reports until its stdin closes, then clean up."""
    state: dict[str, Any] = {"workers": [], "files": [], "dirs": []}
    for line in lines:
        try:
            report = json.loads(line)
        except ValueError:
            continue  # the job died in the middle of a report: what came before stands
        for key in state:
            state[key] += [x for x in report.get(key, []) if x not in state[key]]
    message = clean(state)
    if log is not None:
        with contextlib.suppress(OSError), log.open("a") as out:
            out.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} INFO {message}\n")
    with contextlib.suppress(OSError):
        answer.write("done\n")
        answer.flush()


def main(argv: list[str]) -> None:
    # Leave the job's process tree: the job waits only for this first process, and the
    # second one, reparented away from the job, holds the pipes.
    if os.fork():
        os._exit(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    serve(sys.stdin, sys.stdout, Path(argv[0]) if argv else None)


class Reaper:
    """The job's side: start the reaper, tell it what to clean, and wait for it."""

    def __init__(self, log_path: str | None = None) -> None:
        # -I -S: no environment, no site, no script directory on sys.path (this module's
        # siblings must not shadow the standard library): it starts in milliseconds.
        command = [sys.executable, "-I", "-S", str(Path(__file__).resolve())]
        if log_path:
            command.append(log_path)
        starter = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        starter.wait()  # the reaper itself has forked away by now
        assert starter.stdin is not None and starter.stdout is not None
        self._to: IO[str] | None = starter.stdin
        self._from: IO[str] = starter.stdout
        self.reported: dict[str, set[Any]] = {"workers": set(), "files": set(), "dirs": set()}

    def watch(
        self,
        *,
        workers: Iterable[tuple[int, int]] = (),
        files: Iterable[str] = (),
        dirs: Iterable[str] = (),
    ) -> None:
        """Report what is new since the last report."""
        if self._to is None:
            return
        new = {
            "workers": set(map(tuple, workers)) - self.reported["workers"],
            "files": set(files) - self.reported["files"],
            "dirs": set(dirs) - self.reported["dirs"],
        }
        if not any(new.values()):
            return
        for key, values in new.items():
            self.reported[key] |= values
        report = {key: sorted(values) for key, values in new.items()}
        with contextlib.suppress(BrokenPipeError):
            self._to.write(json.dumps(report) + "\n")
            self._to.flush()

    def finish(self, timeout_s: float = 60.0) -> bool:
        """Close the report and wait until the reaper has cleaned up; False on timeout."""
        if self._to is None:
            return True
        with contextlib.suppress(BrokenPipeError):
            self._to.close()
        self._to = None
        ready, _, _ = select.select([self._from], [], [], timeout_s)
        done = bool(ready) and self._from.readline().strip() == "done"
        self._from.close()
        return done


if __name__ == "__main__":
    main(sys.argv[1:])
