"""One load of the target per capture phase: a capture engine that outlives its shard jobs.

A shard job used to load the target, capture one shard and stop: with a 1T target on 8
GPUs, minutes of engine start per 4 GiB shard, more than the capture itself. Now the
first shard job of a run starts a *capture engine* (this module, run as
``python -m eagle3data.hidden_states.capture_service DIR``), a process of its own that
loads the target once; that job and every later shard job of the run send it their
shard and wait for it, so the target loads once per run per engine group, while the
shards stay what Snakemake sees: one job and one atomic file each (``snakemake -n`` shows
what is left, a shard is re-made by its file target, a killed run resumes).

Why a process of our own and not Snakemake's: a ``service`` rule puts every consumer in
one group job whose resources are summed (notes/snakemake.md, section 14), and a per-phase
job that writes all the shards would hide them from the DAG. Why a Unix socket with
:mod:`multiprocessing.connection`: it frames and authenticates messages and is in the
standard library.

Lifetime, so that nothing outlives the run:

* the engine belongs to the Snakemake run that started it (``EAGLE3DATA_RUN_OWNER``, set
  when the Snakefile is read: host, pid and start time of the driver); it stops within a
  second of that process ending, however it ended (``kill -9`` included), and at once
  when the run ends (the Snakefile's ``onsuccess``/``onerror``: :func:`stop_engines`);
* it stops after ``hidden_states.engine_idle_s`` without a shard (GPUs back for others);
* a shard job that dies mid-shard is noticed at the next batch: the shard's temporary
  file is dropped and the engine waits for the next job;
* any other failure (a rank dies, a bad spec) is sent to the job as its one-line error,
  and the engine stops: the next shard job starts a fresh one.

With the vllm backend the target is in the server the user runs; the engine is its client,
kept for the run so that a shard job pays neither torch's import nor the server's checks.

GPUs: the job that starts an engine takes the GPUs by lock (:mod:`..gpu_slots`) and
hands the locks to the engine, which holds them until it stops; a later job uses an idle
engine of the same settings without taking GPUs, or starts another engine group on free
GPUs when every engine is busy.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ..errors import CaptureEngineError, GpuSlotTimeout
from ..gpu_slots import GpuLease, GpuRequest, acquire_gpus
from .settings import CaptureSettings

if TYPE_CHECKING:
    from .shard_job import ShardJob

log = logging.getLogger(__name__)

OWNER_ENV = "EAGLE3DATA_RUN_OWNER"
# Where engines keep their state (not under the workflow's directory: engines of a run
# are found by name, and a workflow copied or moved must not find another's).
ROOT_ENV = "EAGLE3DATA_CAPTURE_ENGINE_DIR"
# Each engine's own log (its load, its stop, what its backend says), one per engine.
ENGINE_LOG_DIR = "logs/capture_engines"
_POLL_S = 0.25
# An engine writes its pid file within this long of being started (Python's start).
_BEGIN_S = 120.0


class _ClientGone(Exception):
    """The shard job that asked for the shard is gone: drop the shard, serve the next."""


class _StopEngine(Exception):
    """The run asked this engine to stop."""


# --- the run that owns the engines ---------------------------------------------------------


def _started(pid: int) -> str | None:
    """A live process's start time in clock ticks (``/proc/PID/stat`` field 22), which
    tells it from a later one that got its id; None once it has ended (a zombie, whose
    parent has not reaped it yet, has ended: its files are closed, its memory freed)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else fields[19]


def owner_token(pid: int | None = None) -> str:
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}:{pid}:{_started(pid)}"


def mark_run_owner() -> None:
    """Called where the Snakefile is read: this process is the run whose shard jobs share
    engines. A Snakemake that a job of a live run started keeps that run's mark (so its
    jobs share the run's engines); a mark left by a run that ended is replaced."""
    if run_owner() is None:
        os.environ[OWNER_ENV] = owner_token()


def owner_alive(token: str) -> bool:
    host, _, rest = token.partition(":")
    pid, _, started = rest.partition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    return _started(int(pid)) == started


def run_owner() -> str | None:
    """The run this job belongs to, when engines can outlive it here; None otherwise (a
    script run by hand, or a job on another host than its driver)."""
    token = os.environ.get(OWNER_ENV)
    return token if token and owner_alive(token) else None


def uses_engine_service(capture: CaptureSettings) -> bool:
    """Whether shard jobs share one engine per phase (else each loads the target, or with
    vllm starts its own client of the server). Every backend can: transformers and sglang
    load the target in the engine, and a vllm engine keeps its client for the run."""
    return capture.engine_lifetime == "phase" and run_owner() is not None


# --- where engines live --------------------------------------------------------------------


def engines_root() -> Path:
    root = Path(os.environ.get(ROOT_ENV) or tempfile.gettempdir()) / f"eagle3data-{os.getuid()}"
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    return root


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class EngineSpec:
    """What an engine loads and how: engines of equal specs are interchangeable."""

    owner: str
    model_path: str
    capture: CaptureSettings
    threads: int | None
    workdir: str
    log_dir: str
    idle_s: float

    def to_json(self) -> dict[str, Any]:
        return {
            "owner": self.owner,
            "model_path": self.model_path,
            "capture": self.capture.to_json(),
            "threads": self.threads,
            "workdir": self.workdir,
            "log_dir": self.log_dir,
            "idle_s": self.idle_s,
        }

    @property
    def prefix(self) -> str:
        """Engines of this run and these settings are named ``<prefix>-<random>``."""
        settings = {k: v for k, v in self.to_json().items() if k not in ("owner", "idle_s")}
        return f"{_digest(self.owner)}-{_digest(json.dumps(settings, sort_keys=True))}"


def _alive(directory: Path) -> bool:
    try:
        pid, started = (directory / "pid").read_text().split()
    except (OSError, ValueError):
        return False
    return _started(int(pid)) == started


def _address(directory: Path) -> str:
    """The engine's socket, in Linux's abstract namespace: no file to clean up, and no
    limit from the length of the directory's path (about 100 bytes for a socket file)."""
    return f"\0eagle3data-capture-{_digest(str(directory))}"


def _engine_dirs(spec: EngineSpec) -> list[Path]:
    return sorted(engines_root().glob(f"{spec.prefix}-*"))


# --- the shard job's side ------------------------------------------------------------------


@dataclass
class _Claim:
    """An engine this job uses alone: the open ``busy.lock`` is the claim."""

    directory: Path
    busy: IO[str]
    process: subprocess.Popen[bytes] | None = None  # set when this job started it

    def release(self) -> None:
        self.busy.close()


def _try_claim(directory: Path) -> _Claim | None:
    busy = open(directory / "busy.lock", "a+")  # noqa: SIM115 (kept open: it is the claim)
    try:
        fcntl.flock(busy, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        busy.close()
        return None
    return _Claim(directory, busy)


@contextlib.contextmanager
def _choosing(spec: EngineSpec) -> Iterator[None]:
    """One job at a time picks or starts an engine of ``spec`` (two jobs starting two
    engines where one was meant would load the target twice)."""
    with open(engines_root() / f"{spec.prefix}.lock", "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _try_gpus(gpus: GpuRequest, env: dict[str, str]) -> GpuLease | bool | None:
    """The GPUs of a new engine if free now: a lease, ``None`` when none are needed, or
    ``False`` when they are taken."""
    try:
        return acquire_gpus(gpus.count, total=gpus.machine_gpus, timeout_s=0, env=env)
    except GpuSlotTimeout:
        return False


def _start_engine(spec: EngineSpec, lease: GpuLease | None, env: dict[str, str]) -> _Claim:
    directory = engines_root() / f"{spec.prefix}-{secrets.token_hex(3)}"
    directory.mkdir(mode=0o700)
    (directory / "spec.json").write_text(json.dumps(spec.to_json()))
    claim = _try_claim(directory)
    assert claim is not None  # nobody else knows this directory yet
    log_path = Path(spec.log_dir) / f"{directory.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    fds = [fh.fileno() for fh in (lease._files if lease else [])]
    with open(log_path, "ab") as out:
        claim.process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(directory)],
            cwd=spec.workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            # The engine holds the GPU locks from now on (a flock belongs to the open
            # file, which the engine shares), and is no member of the job's process
            # group: the job ends after its shard, the engine does not.
            pass_fds=fds,
            start_new_session=True,
        )
    if lease is not None:
        lease.release()
    log.info(
        "started capture engine %s (pid %d%s); its log: %s",
        directory.name,
        claim.process.pid,
        f", GPUs {','.join(lease.device_ids)}" if lease else "",
        log_path,
    )
    return claim


def _claim_engine(spec: EngineSpec, gpus: GpuRequest) -> _Claim:
    """An idle engine of ``spec``, or a new one on free GPUs; waits up to the GPU lock
    timeout while every engine is busy and no GPUs are free."""
    deadline = time.monotonic() + gpus.timeout_s
    while True:
        with _choosing(spec):
            engines = []
            for directory in _engine_dirs(spec):
                pid_written = (directory / "pid").exists()
                try:
                    never_began = time.time() - directory.stat().st_mtime > _BEGIN_S
                except FileNotFoundError:
                    continue  # it stopped and removed itself just now
                if (pid_written and not _alive(directory)) or (not pid_written and never_began):
                    shutil.rmtree(directory, ignore_errors=True)  # killed: nothing to reuse
                else:
                    engines.append(directory)
            for directory in engines:
                claim = _try_claim(directory)
                if claim is not None:
                    if _alive(directory):
                        return claim
                    claim.release()  # a start that died before it began: not usable
            # On the CPU one engine takes the machine: wait for it rather than start two.
            # So does a vllm engine (no GPUs of its own): one client keeps the server at
            # the max_in_flight the user set, however many shard jobs run at once.
            if gpus.count > 0 or not engines:
                env = dict(os.environ)
                lease = _try_gpus(gpus, env)
                if lease is not False:
                    return _start_engine(spec, lease or None, env)
        if time.monotonic() >= deadline:
            raise GpuSlotTimeout(
                f"waited {gpus.timeout_s:.0f} s for a free capture engine or {gpus.count} "
                f"free GPU(s) to start one; raise gpus.lock_timeout_s, or bound concurrency "
                f"with `snakemake --resources gpu=N`"
            )
        time.sleep(_POLL_S)


def _wait_gone(directory: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _alive(directory) and time.monotonic() < deadline:
        time.sleep(0.1)


def _wait_ready(claim: _Claim) -> Connection:
    """Connect once the engine has loaded the target; its start failure as our error."""
    directory = claim.directory
    while True:
        failed = directory / "failed.json"
        if failed.exists():
            message = json.loads(failed.read_text())["message"]
            _wait_gone(directory)
            shutil.rmtree(directory, ignore_errors=True)  # the engine left it for us
            raise CaptureEngineError(message)
        if (directory / "ready").exists():
            key = (directory / "key").read_bytes()
            return Client(_address(directory), family="AF_UNIX", authkey=key)
        ended = claim.process.poll() if claim.process is not None else None
        if ended is not None or (claim.process is None and not _alive(directory)):
            if failed.exists():
                continue
            raise CaptureEngineError(
                f"capture engine {directory.name} stopped before it was ready "
                f"(exit status {ended}); see its log under logs/capture_engines/"
            )
        time.sleep(_POLL_S)


def capture_on_engine(spec: EngineSpec, gpus: GpuRequest, job: ShardJob) -> None:
    """Have an engine of ``spec`` capture ``job``'s shard; its log lines become this
    job's; its failure, this job's error."""
    claim = _claim_engine(spec, gpus)
    try:
        with _wait_ready(claim) as conn:
            engine = _engine_process(claim.directory)
            conn.send({"op": "extract", "job": job})
            while True:
                try:
                    kind, payload = conn.recv()
                except EOFError:
                    payload = (
                        f"capture engine {claim.directory.name} ended in the middle of the "
                        f"shard; see its log under logs/capture_engines/"
                    )
                    kind = "failed"
                if kind == "log":
                    level, message = payload
                    log.log(level, "%s", message)
                elif kind == "done":
                    return
                else:
                    # A failed shard stops the engine: this job ends once it is gone, as
                    # a job that held the engine itself did.
                    _wait_ended([engine] if engine else [])
                    raise CaptureEngineError(payload)
    finally:
        claim.release()


def capture_with_engine(
    job: ShardJob, capture: CaptureSettings, *, threads: int | None, job_gpus: GpuRequest
) -> None:
    """The hidden_states job with a shared engine: :func:`.extraction.extract_shard`'s
    arguments, and the GPUs an engine started for it takes."""
    spec = EngineSpec(
        owner=os.environ[OWNER_ENV],
        model_path=str(Path(job.model_path).resolve()),
        capture=capture,
        threads=threads,
        workdir=os.getcwd(),
        log_dir=ENGINE_LOG_DIR,
        idle_s=capture.engine_idle_s,
    )
    capture_on_engine(spec, job_gpus, job)


def _engine_process(directory: Path) -> tuple[int, str] | None:
    with contextlib.suppress(OSError, ValueError):
        pid, started = (directory / "pid").read_text().split()
        return int(pid), started
    return None


def _wait_ended(engines: list[tuple[int, str]], timeout_s: float = 120.0) -> None:
    """Until ``engines`` and every process they started are gone (SGLang's workers, and
    multiprocessing's resource tracker, which unlinks what an engine leaves in /dev/shm
    once the engine has ended): what a job's end meant when the job held the engine."""
    from ..servers.processes import Worker, descendants, is_running

    seen: dict[tuple[int, int], Worker] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        running = [pid for pid, started in engines if _started(pid) == started]
        for pid in running:
            seen.update({(w.pid, w.started): w for w in descendants(pid)})
        if not running and not any(is_running(w) for w in seen.values()):
            return
        time.sleep(0.1)


def stop_engines(owner: str | None = None, timeout_s: float = 120.0) -> None:
    """Stop this run's engines and wait until they are gone, with all they started."""
    owner = owner or os.environ.get(OWNER_ENV)
    if not owner:
        return
    engines: list[tuple[int, str]] = []
    for directory in sorted(engines_root().glob(f"{_digest(owner)}-*-*")):
        process = _engine_process(directory)
        if process is not None:
            engines.append(process)
        with contextlib.suppress(OSError):
            (directory / "stop").touch()
    _wait_ended(engines, timeout_s)
    for lock in engines_root().glob(f"{_digest(owner)}-*.lock"):
        lock.unlink(missing_ok=True)


# --- the engine's side ---------------------------------------------------------------------


class _ForwardLogs(logging.Handler):
    """The engine's log lines, while it captures a shard, to the shard's job."""

    def __init__(self, conn: Connection) -> None:
        super().__init__(logging.INFO)
        self.conn = conn

    def emit(self, record: logging.LogRecord) -> None:
        # The job is gone when this fails: the next batch finds out (_Attended).
        with contextlib.suppress(OSError):
            self.conn.send(("log", (record.levelno, record.getMessage())))


class _Attended:
    """The engine's extractor, checking before each batch that the job still waits."""

    def __init__(self, extractor: Any, conn: Connection) -> None:
        self._extractor = extractor
        self._conn = conn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._extractor, name)

    def forward(self, samples: Any, **images: Any) -> Any:
        # The job sends nothing while it waits: anything readable is its end of file.
        if self._conn.poll():
            raise _ClientGone
        return self._extractor.forward(samples, **images)


def _watch(directory: Path, owner: str, idle_s: float, state: dict[str, float]) -> None:
    """Stop the engine (SIGTERM to itself: the main thread may be in a forward) when its
    run is gone, when asked to, or when idle too long."""
    while True:
        time.sleep(_POLL_S)
        idle = state["busy"] == 0 and time.monotonic() - state["since"] > idle_s
        if not owner_alive(owner) or (directory / "stop").exists() or idle:
            why = "asked to stop" if (directory / "stop").exists() else "its run ended"
            if idle and owner_alive(owner):
                why = f"idle for {idle_s:.0f} s"
            state["why"] = why  # type: ignore[assignment]
            os.kill(os.getpid(), signal.SIGTERM)
            return


def serve(directory: Path) -> None:
    """The engine: load the target, capture shards as jobs ask, stop when told."""
    from ..driver_signals import stop_on_signals
    from ..errors import is_user_error
    from ..jobs import setup_logging
    from ..torch_utils import set_threads
    from .backends import build_extractor
    from .extraction import extract_shard

    spec = json.loads((directory / "spec.json").read_text())
    # The engine logs to its own file (stdout, set by the job that started it): the
    # engine backends find their job's log file through the logging handlers.
    setup_logging(str(Path(spec["log_dir"]) / f"{directory.name}.log"))
    logging.getLogger().handlers[:] = [
        h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)
    ]
    stop_on_signals()
    (directory / "pid.tmp").write_text(f"{os.getpid()} {_started(os.getpid())}")
    (directory / "pid.tmp").rename(directory / "pid")  # whole, or not there
    # Busy while loading: a load longer than the idle limit is no idleness.
    state: dict[str, Any] = {"busy": 1, "since": time.monotonic(), "why": "stopped by a signal"}
    threading.Thread(
        target=_watch,
        args=(directory, spec["owner"], float(spec["idle_s"]), state),
        daemon=True,
        name="engine-watch",
    ).start()
    extractor = None
    listener = None
    shards = 0
    try:
        try:
            set_threads(spec["threads"])
            log.info("capture engine %s: loading %s", directory.name, spec["model_path"])
            capture = CaptureSettings.from_json(spec["capture"])
            extractor = build_extractor(spec["model_path"], capture, job=directory.name)
            key = secrets.token_bytes(32)
            (directory / "key").write_bytes(key)
            listener = Listener(_address(directory), family="AF_UNIX", authkey=key)
        except Exception as exc:
            message = str(exc) if is_user_error(exc) else f"{type(exc).__name__}: {exc}"
            log.exception("capture engine %s could not start", directory.name)
            (directory / "failed.json").write_text(json.dumps({"message": message}))
            raise SystemExit(1) from None
        state["busy"], state["since"] = 0, time.monotonic()
        (directory / "ready").touch()
        log.info("capture engine %s: target loaded, waiting for shards", directory.name)
        while True:
            with listener.accept() as conn:
                state["busy"] = 1
                try:
                    message = conn.recv()
                    if message.get("op") != "extract":
                        continue
                    shards += 1
                    forward = _ForwardLogs(conn)
                    logging.getLogger().addHandler(forward)
                    try:
                        log.info(
                            "capture engine %s (pid %d) captures this shard: shard %d of this "
                            "engine, the target loaded once",
                            directory.name,
                            os.getpid(),
                            shards,
                        )
                        attended = _Attended(extractor, conn)
                        extract_shard(message["job"], capture, extractor=attended)
                    except _ClientGone:
                        log.warning("the shard's job is gone: shard dropped, engine kept")
                        continue
                    except Exception as exc:
                        # The job gets the one line; the traceback stays in the engine's log.
                        logging.getLogger().removeHandler(forward)
                        text = str(exc) if is_user_error(exc) else f"{type(exc).__name__}: {exc}"
                        log.exception("capture engine %s: the shard failed", directory.name)
                        with contextlib.suppress(OSError):
                            conn.send(("failed", text))
                        raise _StopEngine from None
                    finally:
                        logging.getLogger().removeHandler(forward)
                    with contextlib.suppress(OSError):
                        conn.send(("done", None))
                except EOFError:
                    continue
                finally:
                    state["busy"] = 0
                    state["since"] = time.monotonic()
    except _StopEngine:
        log.info("capture engine %s stops after a failed shard", directory.name)
    except KeyboardInterrupt:
        log.info("capture engine %s stops: %s", directory.name, state["why"])
    finally:
        if listener is not None:
            listener.close()
        close = getattr(extractor, "close", None)
        if close is not None:
            close()
        log.info("capture engine %s: %d shard(s) served, stopped", directory.name, shards)
        if not (directory / "failed.json").exists():  # else the job reads it, then removes all
            shutil.rmtree(directory, ignore_errors=True)
        if not owner_alive(spec["owner"]):
            # No job of a dead run can be choosing an engine: its lock file goes too.
            prefix = directory.name.rsplit("-", 1)[0]
            (directory.parent / f"{prefix}.lock").unlink(missing_ok=True)


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
