"""Append-only journals (generation sidecars) and atomic file writes."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3data.atomic import (
    atomic_open,
    atomic_path,
    dumps_line,
    remove_stale_temporaries,
    write_json,
    write_jsonl,
)
from eagle3data.generation.journal import JournalLockedError, JournalWriter, read_journal

# --------------------------------------------------------------------------- journal


def test_read_missing_journal_yields_nothing(tmp_path):
    assert list(read_journal(tmp_path / "nope.jsonl")) == []


def test_append_and_reopen_preserves_records(tmp_path):
    path = tmp_path / "work" / "deep" / "j.jsonl"  # parents are created
    with JournalWriter(path) as j:
        assert j.repaired_bytes == 0
        j.append({"id": "a", "n": 1})
        j.append_many([{"id": "b", "n": 2}, {"id": "c", "text": "naïve ✓"}])
        j.append_many([])  # no-op
    assert list(read_journal(path)) == [
        {"id": "a", "n": 1},
        {"id": "b", "n": 2},
        {"id": "c", "text": "naïve ✓"},
    ]
    with JournalWriter(path) as j:
        assert j.repaired_bytes == 0
        j.append({"id": "d"})
    assert [r["id"] for r in read_journal(path)] == ["a", "b", "c", "d"]
    # one record per line, canonical bytes
    assert path.read_bytes().decode().splitlines()[0] == dumps_line({"id": "a", "n": 1}).strip()


def test_records_are_visible_to_readers_while_the_writer_is_open(tmp_path):
    path = tmp_path / "j.jsonl"
    with JournalWriter(path) as j:
        j.append({"id": "a"})
        assert list(read_journal(path)) == [{"id": "a"}]
        j.append({"id": "b"})
        assert [r["id"] for r in read_journal(path)] == ["a", "b"]


def test_torn_last_line_is_ignored_then_repaired(tmp_path):
    path = tmp_path / "j.jsonl"
    with JournalWriter(path) as j:
        j.append_many([{"id": "a"}, {"id": "b"}])
    good = path.read_bytes()
    torn = b'{"id":"c","messages":[{"role":"user","con'
    with open(path, "ab") as fh:
        fh.write(torn)
    assert [r["id"] for r in read_journal(path)] == ["a", "b"]
    with JournalWriter(path) as j:
        assert j.repaired_bytes == len(torn)
        assert path.read_bytes() == good
        j.append({"id": "c"})
    assert [r["id"] for r in read_journal(path)] == ["a", "b", "c"]
    with JournalWriter(path) as j:
        assert j.repaired_bytes == 0


def test_torn_tail_that_parses_as_json_is_still_torn(tmp_path):
    path = tmp_path / "j.jsonl"
    path.write_bytes(b'{"id":"a"}\n{"id":"b"}')  # complete JSON, but no newline: not acked
    assert [r["id"] for r in read_journal(path)] == ["a"]
    with JournalWriter(path) as j:
        assert j.repaired_bytes == len(b'{"id":"b"}')
    assert path.read_bytes() == b'{"id":"a"}\n'


def test_torn_only_line_is_truncated_to_empty(tmp_path):
    path = tmp_path / "j.jsonl"
    path.write_bytes(b'{"id":"a","x":')
    assert list(read_journal(path)) == []
    with JournalWriter(path) as j:
        assert j.repaired_bytes == 14
        j.append({"id": "z"})
    assert list(read_journal(path)) == [{"id": "z"}]


def test_torn_tail_longer_than_the_scan_block(tmp_path):
    # Records and the torn tail larger than the 64 KiB backward-scan block.
    path = tmp_path / "j.jsonl"
    big = {"id": "a", "blob": "x" * 150_000}
    with JournalWriter(path) as j:
        j.append(big)
    good = path.read_bytes()
    tail = b'{"id":"b","blob":"' + b"y" * 200_000
    with open(path, "ab") as fh:
        fh.write(tail)
    assert list(read_journal(path)) == [big]
    with JournalWriter(path) as j:
        assert j.repaired_bytes == len(tail)
        j.append({"id": "c"})
    assert path.read_bytes()[: len(good)] == good
    assert [r["id"] for r in read_journal(path)] == ["a", "c"]


def test_second_writer_in_the_same_process_is_refused(tmp_path):
    path = tmp_path / "j.jsonl"
    with JournalWriter(path) as j:
        j.append({"id": "a"})
        with pytest.raises(JournalLockedError, match=str(path)):
            JournalWriter(path)
        j.append({"id": "b"})  # the first writer is unaffected
    # released on close
    with JournalWriter(path) as j:
        j.append({"id": "c"})
    assert [r["id"] for r in read_journal(path)] == ["a", "b", "c"]


def test_refused_writer_does_not_repair_or_touch_the_file(tmp_path):
    path = tmp_path / "j.jsonl"
    with JournalWriter(path) as j:
        j.append({"id": "a"})
        # the live writer may be mid-append: a second opener must not truncate it
        with open(path, "ab") as fh:
            fh.write(b'{"id":"b"')
        before = path.read_bytes()
        with pytest.raises(JournalLockedError):
            JournalWriter(path)
        assert path.read_bytes() == before


_HOLDER = """
import sys, time
from eagle3data.generation.journal import JournalWriter
w = JournalWriter(sys.argv[1])
w.append({"id": "from-child"})
print("locked", flush=True)
time.sleep(60)
"""


def _start_holder(path: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    if line.strip() != "locked":
        proc.kill()
        proc.wait()
        pytest.fail(f"lock holder did not start: {line!r} {proc.stderr.read()}")
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
    proc.stdout.close()
    proc.stderr.close()


def test_writer_in_another_process_blocks_until_it_is_killed(tmp_path):
    path = tmp_path / "j.jsonl"
    proc = _start_holder(path)
    try:
        with pytest.raises(JournalLockedError):
            JournalWriter(path)
        assert list(read_journal(path)) == [{"id": "from-child"}]
        # SIGKILL: no cleanup runs in the child, the OS drops the lock with the process
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert proc.returncode == -signal.SIGKILL
        deadline = time.monotonic() + 5
        while True:
            try:
                w = JournalWriter(path)
                break
            except JournalLockedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        with w:
            w.append({"id": "after"})
        assert [r["id"] for r in read_journal(path)] == ["from-child", "after"]
    finally:
        _stop(proc)


def test_stale_lock_file_from_a_dead_process_does_not_block(tmp_path):
    path = tmp_path / "j.jsonl"
    path.with_name(path.name + ".lock").write_text("")  # left behind by a dead job
    with JournalWriter(path) as j:
        j.append({"id": "a"})
    assert list(read_journal(path)) == [{"id": "a"}]


# --------------------------------------------------------------------------- atomic writes


def _leftovers(directory: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name not in keep)


def test_write_json_and_jsonl_content(tmp_path):
    write_json(tmp_path / "a.json", {"b": 1, "a": "é"})
    assert json.loads((tmp_path / "a.json").read_text(encoding="utf-8")) == {"a": "é", "b": 1}
    assert (tmp_path / "a.json").read_text(encoding="utf-8").endswith("\n")
    write_jsonl(tmp_path / "b.jsonl", ({"i": i} for i in range(3)))
    assert (tmp_path / "b.jsonl").read_text() == '{"i":0}\n{"i":1}\n{"i":2}\n'
    write_jsonl(tmp_path / "empty.jsonl", [])
    assert (tmp_path / "empty.jsonl").read_bytes() == b""
    assert _leftovers(tmp_path, {"a.json", "b.jsonl", "empty.jsonl"}) == []


def test_write_json_creates_parent_directories(tmp_path):
    target = tmp_path / "x" / "y" / "z.json"
    write_json(target, [1])
    assert json.loads(target.read_text()) == [1]


def test_write_json_failure_leaves_no_file(tmp_path):
    target = tmp_path / "a.json"
    with pytest.raises(TypeError):
        write_json(target, {"ok": 1, "bad": object()})
    assert not target.exists()
    assert _leftovers(tmp_path, set()) == []


def test_write_jsonl_failure_midway_keeps_the_old_file(tmp_path):
    target = tmp_path / "rows.jsonl"
    write_jsonl(target, [{"old": True}])
    old = target.read_bytes()

    def rows():
        yield {"new": 1}
        yield {"new": 2}
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError, match="killed mid-write"):
        write_jsonl(target, rows())
    assert target.read_bytes() == old
    assert _leftovers(tmp_path, {"rows.jsonl"}) == []


def test_atomic_path_replaces_on_success_and_hides_the_temp(tmp_path):
    target = tmp_path / "shard.h5"
    target.write_bytes(b"old")
    with atomic_path(target) as tmp:
        assert tmp != target
        assert tmp.parent == target.parent  # same filesystem: rename is atomic
        tmp.write_bytes(b"new")
        assert target.read_bytes() == b"old"  # not visible until the block ends
    assert target.read_bytes() == b"new"
    assert _leftovers(tmp_path, {"shard.h5"}) == []


def test_atomic_path_failure_leaves_no_file(tmp_path):
    target = tmp_path / "shard.h5"
    with pytest.raises(ValueError), atomic_path(target) as tmp:
        tmp.write_bytes(b"partial")
        raise ValueError("boom")
    assert not target.exists()
    assert _leftovers(tmp_path, set()) == []


def test_atomic_path_failure_keeps_the_previous_file(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("previous")
    with pytest.raises(KeyboardInterrupt), atomic_open(target) as fh:
        fh.write("half")
        raise KeyboardInterrupt
    assert target.read_text() == "previous"
    assert _leftovers(tmp_path, {"out.json"}) == []


def test_atomic_open_rejects_non_write_modes(tmp_path):
    with pytest.raises(ValueError), atomic_open(tmp_path / "x", "r"):
        pass


@pytest.fixture
def umask():
    saved = os.umask(0o022)
    os.umask(saved)

    def set_mask(mask: int) -> None:
        os.umask(mask)

    yield set_mask
    os.umask(saved)


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_atomic_outputs_follow_the_umask_not_0600(tmp_path, umask, mask):
    umask(mask)
    write_json(tmp_path / "a.json", {})
    write_jsonl(tmp_path / "b.jsonl", [{}])
    with atomic_path(tmp_path / "c.bin") as tmp:
        tmp.write_bytes(b"x")
    expected = 0o666 & ~mask
    for name in ("a.json", "b.jsonl", "c.bin"):
        mode = stat.S_IMODE((tmp_path / name).stat().st_mode)
        assert mode == expected, (name, oct(mode), oct(expected))
    if mask == 0o022:
        assert expected & stat.S_IRGRP and expected & stat.S_IROTH


# --------------------------------------------------------------------------- stale temporaries

_WRITER = """
import sys, time
from eagle3data.atomic import atomic_path
with atomic_path(sys.argv[1]) as tmp:
    tmp.write_bytes(b"half-written")
    print(tmp, flush=True)
    time.sleep(600)
"""


def _start_writer(target: Path) -> tuple[subprocess.Popen[str], Path]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(target)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    return proc, Path(proc.stdout.readline().strip())


def _age(path: Path, seconds: float) -> None:
    old = time.time() - seconds
    os.utime(path, (old, old))


def test_a_killed_writers_temporary_is_removed_by_the_next_write(tmp_path):
    target = tmp_path / "shard-00001.h5"
    proc, tmp = _start_writer(target)
    assert tmp.exists() and tmp.name.startswith(".shard-00001.h5.")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert tmp.exists(), "SIGKILL skips every cleanup"
    unrelated = tmp_path / ".shard-00002.h5.1.abc.tmp"
    unrelated.write_text("another target's")
    _age(unrelated, 3600)

    write_json(target, {"done": True})
    assert not tmp.exists()
    assert unrelated.exists(), "only temporaries of the target being written are touched"
    assert json.loads(target.read_text()) == {"done": True}


def test_a_live_writers_temporary_is_never_removed(tmp_path):
    target = tmp_path / "out.json"
    proc, tmp = _start_writer(target)
    try:
        _age(tmp, 3600)  # even when old: its writer is still running
        assert remove_stale_temporaries(target) == []
        write_json(target, {"second": "writer"})
        assert tmp.read_bytes() == b"half-written"
    finally:
        proc.kill()
        proc.wait()
    assert remove_stale_temporaries(target) == [tmp]


def test_temporaries_of_other_hosts_or_unknown_writers_are_kept(tmp_path):
    from eagle3data import atomic

    target = tmp_path / "x.json"
    dead_pid = _start_writer(tmp_path / "y.json")[0]
    dead_pid.kill()
    dead_pid.wait()
    other_host = tmp_path / f".x.json.other-node_{dead_pid.pid}.abcd.tmp"
    unknown = tmp_path / ".x.json.abcd.tmp"
    ours = tmp_path / f".x.json.{atomic.HOST}_{dead_pid.pid}.abcd.tmp"
    for path in (other_host, unknown, ours):
        path.write_text("")
    assert remove_stale_temporaries(target) == [ours]
    assert other_host.exists() and unknown.exists()


def test_library_writers_work_on_the_temporary(tmp_path):
    import h5py
    import polars as pl

    with atomic_path(tmp_path / "a.h5") as tmp, h5py.File(tmp, "w") as f:
        f["x"] = [1, 2, 3]
    with atomic_path(tmp_path / "b.parquet") as tmp:
        pl.DataFrame({"x": [1, 2, 3]}).write_parquet(tmp)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.h5", "b.parquet"]
