"""Durable file writes.

A declared output must exist only when complete, so every writer goes through
a temporary file in the destination directory (same filesystem, so the final
``os.replace`` is atomic) that is fsynced before the rename, with the
directory fsynced after it so the rename itself survives a power loss.

A killed writer leaves its temporary behind; the temporary's name says which
host and process wrote it, so the next writer of the same target removes the
ones whose process is gone and never one that a live process is still writing.
:func:`atomic_directory` does the same for a whole directory of files.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path; rename it onto ``path`` if the block succeeds.

    The caller writes the temporary file itself (useful for libraries such as
    h5py or polars that want a file name); it is fsynced before the rename.
    Temporaries that killed writers left for the same target are removed first.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(target)
    fd, tmp_name = tempfile.mkstemp(
        prefix=f"{_temp_prefix(target)}{_WRITER_TAG}.", suffix=TEMP_SUFFIX, dir=target.parent
    )
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; outputs are shared data
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, target)
        fsync_dir(target.parent)
    finally:
        tmp.unlink(missing_ok=True)


TEMP_SUFFIX = ".tmp"
# This machine, as writers name themselves (temporaries here, journal run files).
HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"
# Who writes a temporary is part of its name: ``.<target>.<host>_<pid>.<random>.tmp``.
# (A lock on the file itself would clash with HDF5's own file locking.)
_WRITER_TAG = f"{HOST}_{os.getpid()}"


def _temp_prefix(target: Path) -> str:
    return f".{target.name}."


def remove_stale_temporaries(target: str | os.PathLike[str]) -> list[Path]:
    """Delete temporaries of ``target`` whose writer is dead; return what was removed.

    Only this host's temporaries are judged (by whether the writing pid still
    exists), so a live writer on another machine sharing the directory is never
    disturbed; a reused pid merely keeps a stale file. Anything else is kept.
    """
    target = Path(target)
    prefix = _temp_prefix(target)
    removed = []
    for tmp in target.parent.glob(f"{glob.escape(prefix)}*{TEMP_SUFFIX}"):
        if _writer_gone(tmp.name[len(prefix) :].split(".", 1)[0]):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def live_temporaries(directory: str | os.PathLike[str]) -> list[Path]:
    """Temporaries in ``directory`` that a live process of this host is writing now
    (the status command's sign that a job is at work there; other hosts' are not judged)."""
    live = []
    for tmp in Path(directory).glob(f".*{TEMP_SUFFIX}"):
        # .<target>.<host>_<pid>.<random>.tmp: the tag is the second-to-last dotted part.
        parts = tmp.name[: -len(TEMP_SUFFIX)].rsplit(".", 2)
        host, _, pid = parts[-2].rpartition("_") if len(parts) == 3 else ("", "", "")
        if host == HOST and pid.isdigit() and pid_alive(int(pid)):
            live.append(tmp)
    return live


def _writer_gone(tag: str) -> bool:
    """Whether the writer a ``<host>_<pid>`` tag names is a dead process of this host."""
    host, _, pid = tag.rpartition("_")
    return host == HOST and pid.isdigit() and not pid_alive(int(pid))


def pid_alive(pid: int) -> bool:
    """Whether a process of this host has the id ``pid`` (a reused id reads as alive)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "w") -> Iterator[IO[Any]]:
    """Open a temporary file for writing that replaces ``path`` on success."""
    if "w" not in mode:
        raise ValueError("atomic_open only supports write modes")
    encoding = None if "b" in mode else "utf-8"
    with atomic_path(path) as tmp, open(tmp, mode, encoding=encoding) as fh:
        yield fh
        fh.flush()


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    with atomic_open(path) as fh:
        json.dump(obj, fh, indent=2, sort_keys=True, ensure_ascii=False)
        fh.write("\n")


def write_jsonl(path: str | os.PathLike[str], rows: Iterable[Any]) -> None:
    with atomic_open(path) as fh:
        for row in rows:
            fh.write(dumps_line(row))


def dumps_line(obj: Any) -> str:
    """One JSON Lines record; compact and key-sorted so equal rows are equal bytes."""
    return json.dumps(obj, ensure_ascii=False, sort_keys=True, separators=(",", ":")) + "\n"


@contextlib.contextmanager
def atomic_directory(target: Path, work_dir: Path) -> Iterator[Path]:
    """Yield an empty temporary directory that replaces ``target`` if the block succeeds.

    The temporary lives in ``work_dir`` (same filesystem as ``target``, so the rename
    is atomic) and is named after its writer, so a later run removes what a killed
    one left without touching a live writer's.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    prefix = f"{target.name}."
    for stale in work_dir.glob(f"{glob.escape(prefix)}*{TEMP_SUFFIX}"):
        if _writer_gone(stale.name[len(prefix) : -len(TEMP_SUFFIX)]):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = work_dir / f"{prefix}{_WRITER_TAG}{TEMP_SUFFIX}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        for sub in [tmp, *(p for p in tmp.iterdir() if p.is_dir())]:
            fsync_dir(sub)
        if target.exists():  # Snakemake removes old outputs first; a manual call may not
            shutil.rmtree(target)
        os.replace(tmp, target)
        fsync_dir(target.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
