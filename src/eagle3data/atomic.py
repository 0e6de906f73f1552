"""Durable file writes.

A declared output must exist only when complete, so every writer goes through
a temporary file in the destination directory (same filesystem, so the final
``os.replace`` is atomic) that is fsynced before the rename, with the
directory fsynced after it so the rename itself survives a power loss.
"""

from __future__ import annotations

import contextlib
import json
import os
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
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; outputs are shared data
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, target)
        fsync_dir(target.parent)
    finally:
        tmp.unlink(missing_ok=True)


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
