"""Append-only JSON Lines journals (the generation sidecars); what a record holds is
defined in :mod:`.records`.

Each record is appended with one ``write`` and fsynced, so after any kill the
file holds every record that was acknowledged plus at most one torn last line
(a power loss mid-write). Opening a journal for append repairs that tail by
truncating it away; reading tolerates it.

Who writes a journal is recorded beside it (``{key}.run.json``, :mod:`..liveness`), so
the status command can tell a running job from a stopped one without touching the lock.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

from ..atomic import dumps_line, fsync_dir
from ..errors import JournalCorruptError, JournalLockedError
from ..liveness import Heartbeat


def read_journal(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yield complete records; a torn final line (no trailing newline) is ignored."""
    p = Path(path)
    if not p.exists():
        return
    with open(p, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.endswith(b"\n"):
                return  # torn tail of a killed writer
            try:
                yield json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise JournalCorruptError(
                    f"{p}:{lineno}: unreadable sidecar record ({exc}); this file is only ever "
                    "appended to, so something else wrote to it: move it away to start over"
                ) from None


def _truncate_torn_tail(fh: Any) -> int:
    """Cut the file back to its last newline; return the number of bytes removed."""
    size = fh.seek(0, os.SEEK_END)
    if size == 0:
        return 0
    # Scan backwards in blocks for the last newline: records can be large.
    pos = size
    block = 1 << 16
    while pos > 0:
        start = max(0, pos - block)
        fh.seek(start)
        chunk = fh.read(pos - start)
        idx = chunk.rfind(b"\n")
        if idx >= 0:
            keep = start + idx + 1
            break
        pos = start
    else:
        keep = 0
    if keep < size:
        fh.truncate(keep)
        os.fsync(fh.fileno())
    return size - keep


class JournalWriter:
    """Exclusive appender: holds an OS lock that dies with the process.

    The lock stops two writers (e.g. an orphaned job after its Snakemake driver
    was SIGKILLed and a fresh run) from interleaving records.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_fh = open(self.path.with_name(self.path.name + ".lock"), "a")  # noqa: SIM115
        try:
            fcntl.flock(self._lock_fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_fh.close()
            raise JournalLockedError(
                f"{self.path} is being written by another running process; "
                "stop it (or wait for it) before starting this job again"
            ) from None
        existed = self.path.exists()
        self._fh = open(self.path, "ab+")  # noqa: SIM115
        self.repaired_bytes = _truncate_torn_tail(self._fh)
        if not existed:
            fsync_dir(self.path.parent)
        self._heartbeat = Heartbeat(self.path)

    def append(self, record: dict[str, Any]) -> None:
        self.append_many([record])

    def append_many(self, records: list[dict[str, Any]]) -> None:
        """Append records with one write, so a kill leaves a batch whole or absent."""
        if not records:
            return
        data = "".join(dumps_line(r) for r in records).encode()
        self._fh.write(data)
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        # While the lock is still ours: the next writer's run file is never overwritten.
        self._heartbeat.stop()
        self._fh.close()
        self._lock_fh.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
