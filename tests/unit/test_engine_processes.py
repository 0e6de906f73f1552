"""The SGLang engine's processes seen from the job (which worker ended, and how), and the
reaper that removes what they leave in /dev/shm when the job ends, however it ends.

Real processes throughout: spawned children, a grandchild left a zombie, named
semaphores and shared-memory segments, and a job killed with SIGKILL.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from multiprocessing import shared_memory
from pathlib import Path

import pytest

from eagle3data.servers import processes as engine_processes
from eagle3data.servers.processes import EngineWatch, Worker, describe_end, shm_files
from eagle3data.servers.reaper import Reaper

SPAWN = multiprocessing.get_context("spawn")
needs_dev_shm = pytest.mark.skipif(
    not os.access("/dev/shm", os.W_OK), reason="needs a writable /dev/shm"
)


def _sleep() -> None:
    time.sleep(120)


def _exit_with(code: int) -> None:
    os._exit(code)


def wait_until(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("title", "name"),
    [
        ("sglang::scheduler_TP1", "scheduler TP1"),
        ("sglang::scheduler_DP1_TP1_EP1", "scheduler DP1 TP1 EP1"),
        ("sglang::detokenizer", "detokenizer"),
        ("sglang::data_parallel_controller", "data parallel controller"),
        (
            "python -c from multiprocessing.resource_tracker",
            "python -c from multiprocessing.resource_tracker",
        ),
    ],
)
def test_worker_names_come_from_sglangs_process_titles(title, name):
    assert Worker(1, 0, title).name == name


def test_wait_statuses_in_words():
    assert describe_end(signal.SIGKILL) == "was killed by SIGKILL"
    assert describe_end(3 << 8) == "exited with code 3"
    # Real-time signals have no name in signal.Signals (they once raised here).
    assert describe_end(signal.SIGRTMIN + 3) == "was killed by SIGRTMIN+3"
    assert describe_end(0) == "ended after an error"


def test_the_watch_names_the_worker_killed_and_ignores_processes_from_before():
    older = SPAWN.Process(target=_sleep)
    older.start()
    try:
        before = engine_processes.process_keys(engine_processes.descendants(os.getpid()))
        ranks = [SPAWN.Process(target=_sleep) for _ in range(2)]
        for p in ranks:
            p.start()
        watch = EngineWatch(before)
        assert sorted(w.pid for w in watch.workers) == sorted(p.pid for p in ranks)
        assert watch.ended() == []
        os.kill(ranks[1].pid, signal.SIGKILL)
        line = watch.failure(wait_s=10)
        assert f"(pid {ranks[1].pid}) was killed by SIGKILL" in line
        assert str(ranks[0].pid) not in line
        assert watch.running_pids() == [ranks[0].pid]
    finally:
        for p in (older, *ranks):
            p.kill()
            p.join()


def test_a_worker_that_exits_is_named_with_its_code_after_a_short_wait():
    before = engine_processes.process_keys(engine_processes.descendants(os.getpid()))
    worker = SPAWN.Process(target=_exit_with, args=(3,))
    worker.start()
    watch = EngineWatch(before)
    line = watch.failure(wait_s=30)
    worker.join()
    assert line.startswith("SGLang worker ")
    assert line.endswith(
        f"(pid {worker.pid}) exited with code 3 (its traceback is above in this job's log)"
    )


def test_a_grandchild_killed_is_read_from_its_zombie():
    """Schedulers of a data-parallel engine are the controller's children: the job sees
    them only in /proc, where a dead one waits as a zombie with its wait status."""
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(120)\n",  # never reaps its child
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        grandchild = int(parent.stdout.readline())
        watch = EngineWatch(set())
        assert grandchild in [w.pid for w in watch.workers]
        os.kill(grandchild, signal.SIGKILL)
        wait_until(lambda: any(w.pid == grandchild for w, _ in watch.ended()))
        (end,) = [e for w, e in watch.ended() if w.pid == grandchild]
        assert end == "was killed by SIGKILL"
    finally:
        parent.kill()
        parent.wait()


@needs_dev_shm
def test_shm_files_finds_segments_and_semaphores_by_inode():
    segment = shared_memory.SharedMemory(create=True, size=4096)
    lock = SPAWN.Lock()  # a named POSIX semaphore, /dev/shm/sem.mp-*
    try:
        found = shm_files([os.getpid()])
        assert f"/dev/shm/{segment.name.lstrip('/')}" in found
        assert any(Path(f).name.startswith("sem.mp-") for f in found)
        assert shm_files([]) == set()
    finally:
        del lock
        segment.close()
        segment.unlink()


JOB = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from multiprocessing import shared_memory
    sys.path.insert(0, sys.argv[1])
    from eagle3data.servers.reaper import Reaper
    reaper = Reaper(sys.argv[2])
    # In a session of its own: the kill of the job's group does not reach it, as a worker
    # that outlives its job.
    worker = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True
    )
    segment = shared_memory.SharedMemory(create=True, size=1 << 20)
    os.makedirs(sys.argv[3])
    started = int(open(f"/proc/{worker.pid}/stat").read().rsplit(")", 1)[1].split()[19])
    reaper.watch(
        workers=[(worker.pid, started)],
        files=["/dev/shm/" + segment.name.lstrip("/")],
        dirs=[sys.argv[3]],
    )
    print(worker.pid, segment.name, flush=True)
    if sys.argv[4] == "finish":
        sys.stdin.readline()  # the test has seen what the reaper is to remove
        worker.kill(); worker.wait()
        print(reaper.finish(), flush=True)
    time.sleep(120)
    """
)


@needs_dev_shm
@pytest.mark.parametrize("end", ["kill -9", "finish"])
def test_the_reaper_cleans_up_after_the_job_however_it_ends(tmp_path, end):
    src = Path(__file__).resolve().parents[2] / "src"
    log = tmp_path / "job.log"
    handoff_dir = tmp_path / "handoff"
    job = subprocess.Popen(
        [sys.executable, "-c", JOB, str(src), str(log), str(handoff_dir), end.split()[0]],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the job's group is killed below, as a test kills a run
    )
    try:
        assert job.stdout is not None
        pid, name = job.stdout.readline().split()
        segment = Path("/dev/shm") / name.lstrip("/")
        assert segment.exists() and handoff_dir.is_dir()
        if end == "kill -9":
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        else:
            assert job.stdin is not None
            job.stdin.write("finish\n")
            job.stdin.flush()
            assert job.stdout.readline().strip() == "True"  # finish() waited for it
        wait_until(lambda: not segment.exists() and not handoff_dir.exists())
        wait_until(lambda: not Path(f"/proc/{pid}").exists())
        wait_until(lambda: "SGLang engine cleaned up" in log.read_text() if log.exists() else False)
        line = log.read_text()
        killed = "1 worker process(es) killed" if end == "kill -9" else "0 worker process(es)"
        assert killed in line and "1 shared-memory file(s) removed (1.0 MiB)" in line
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()


def test_a_report_cut_short_by_the_jobs_death_is_ignored(tmp_path):
    from eagle3data.servers import reaper as engine_reaper

    keep = tmp_path / "keep"
    keep.write_text("x")
    gone = tmp_path / "gone"
    gone.write_text("x")
    lines = [json.dumps({"files": [str(gone)]}) + "\n", '{"files": ["' + str(keep)]
    answer = tmp_path / "answer"
    with answer.open("w") as out:
        engine_reaper.serve(iter(lines), out, None)
    assert not gone.exists() and keep.exists()
    assert answer.read_text() == "done\n"


def test_reaper_reports_only_what_is_new(tmp_path):
    reaper = Reaper(None)
    try:
        reaper.watch(files=["/dev/shm/a"], dirs=[str(tmp_path / "d")])
        reaper.watch(files=["/dev/shm/a", "/dev/shm/b"])
        assert reaper.reported["files"] == {"/dev/shm/a", "/dev/shm/b"}
    finally:
        assert reaper.finish()
