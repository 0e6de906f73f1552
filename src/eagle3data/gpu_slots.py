"""Which GPUs a job may use: one exclusive lock file per GPU.

Snakemake counts GPUs (``resources: gpu=N`` with ``--resources gpu=M``) but never
says *which* ones a job gets. A job that needs N GPUs therefore takes
non-blocking exclusive ``flock``s on N per-GPU lock files in a shared directory,
keeps them open for the rest of its life, and sets ``CUDA_VISIBLE_DEVICES``
before torch or sglang are imported. The kernel drops a flock when its holder
dies, however it dies (SIGKILL included), so a killed job never leaks a GPU.

When the scheduler already assigned devices (SLURM ``--gpus``, the Kubernetes
device plugin), ``CUDA_VISIBLE_DEVICES`` names exactly the job's GPUs and is taken
as is; when it names more (a run restricted to some GPUs by hand), the jobs share
those by lock.

This module must not import torch: it runs before anything that initialises CUDA.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Self

from .errors import GpuSlotError, GpuSlotTimeout
from .layout import GPU_LOCKS
from .schema import from_schema

log = logging.getLogger(__name__)

DEFAULT_LOCK_DIR = GPU_LOCKS
LOCK_DIR_ENV = "EAGLE3DATA_GPU_LOCK_DIR"
VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


@dataclass
class GpuLease:
    """GPUs held by this process. The open files *are* the locks: keep the lease."""

    device_ids: tuple[str, ...]
    assigned_by_scheduler: bool
    count: int = 0  # GPUs the job asked for (a scheduler may have assigned more)
    _files: list[IO[str]] = field(default_factory=list, repr=False)

    def release(self) -> None:
        for fh in self._files:
            fh.close()  # closing the last descriptor drops the flock
        self._files.clear()


# Leases of this process: module-level so the locks live as long as the process.
_HELD: list[GpuLease] = []


def held_gpu_count() -> int | None:
    """GPUs this process's job asked for, or None when it took none through here."""
    return sum(lease.count for lease in _HELD) if _HELD else None


def detect_gpu_count(env: Mapping[str, str] | None = None) -> int:
    """GPUs this machine has, without importing torch (0 when there is no driver).

    ``CUDA_VISIBLE_DEVICES`` wins when set (it is what CUDA will show); otherwise
    ``nvidia-smi -L`` prints one ``GPU i: ...`` line per device.
    """
    env = os.environ if env is None else env
    visible = env.get(VISIBLE_ENV)
    if visible is not None:
        return len(parse_visible(visible))
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run(
            [smi, "-L"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def parse_visible(value: str) -> list[str]:
    """Device ids in a ``CUDA_VISIBLE_DEVICES`` value ('' means none)."""
    return [part.strip() for part in value.split(",") if part.strip()]


def resolve_gpus_per_job(
    setting: int | str,
    *,
    device: str = "auto",
    uses_gpu_backend: bool = True,
    backend_gpus: int | None = None,
    machine_gpus: int,
) -> int:
    """The ``gpu`` resource of a job from its ``gpus_per_job`` setting.

    ``auto``: a backend that fixes its GPU count (sglang's tp_size) gets that many;
    a torch backend gets one GPU when its device can be CUDA and the machine has
    one, else none; a backend that computes elsewhere (HTTP) gets none.
    """
    if not isinstance(setting, str):
        return int(setting)
    if setting != "auto":
        raise ValueError(f"gpus_per_job must be 'auto' or an integer, got {setting!r}")
    if not uses_gpu_backend:
        return 0
    if backend_gpus is not None:
        return backend_gpus
    if device.startswith(("cpu", "mps")):
        return 0
    return 1 if machine_gpus > 0 else 0


def machine_gpu_count(config: Mapping[str, Any]) -> int:
    """``gpus.count`` from the config, or what :func:`detect_gpu_count` finds."""
    count = (config.get("gpus") or {}).get("count", "auto")
    return detect_gpu_count() if count == "auto" else int(count)


def sglang_gpus(options: Mapping[str, Any]) -> int:
    """GPUs of one SGLang engine: ``tp_size`` per replica, ``dp_size`` replicas, except
    that data-parallel attention splits attention inside the ``tp_size`` GPUs."""
    tp = int(options.get("tp_size", 1))
    if options.get("enable_dp_attention", False):
        return tp
    return tp * int(options.get("dp_size", 1))


def job_gpus(config: Mapping[str, Any], stage: str) -> int:
    """The ``gpu`` resource of a ``generation`` or ``hidden_states`` job."""
    section = config[stage]
    backend = section.get("backend", "transformers")
    backend_gpus = None
    device = str(section.get("device", "auto"))
    if stage == "hidden_states" and backend == "sglang":
        # SGLang's CPU engine (device cpu: Xeon AMX servers, the test suite) takes no GPU.
        on_cpu = device.startswith("cpu")
        backend_gpus = 0 if on_cpu else sglang_gpus(section.get("sglang") or {})
    setting = section.get("gpus_per_job", "auto")
    gpus = resolve_gpus_per_job(
        setting,
        device=device,
        # Servers own their GPUs: generation's openai backend, the vllm capture backend.
        uses_gpu_backend=backend not in ("openai", "vllm"),
        backend_gpus=backend_gpus,
        machine_gpus=machine_gpu_count(config) if setting == "auto" else 0,
    )
    if backend_gpus is not None and gpus < backend_gpus:
        raise ValueError(
            f"{stage}.gpus_per_job={gpus} is less than the {backend_gpus} GPUs of "
            f"{stage}.sglang's layout (tp_size, times dp_size without enable_dp_attention): "
            f"each rank needs a GPU of its own"
        )
    return gpus


def acquire_gpus(
    count: int,
    *,
    lock_dir: str | Path | None = None,
    total: int | None = None,
    timeout_s: float = 600.0,
    poll_s: float = 2.0,
    env: MutableMapping[str, str] | None = None,
) -> GpuLease | None:
    """Hold ``count`` GPUs for the rest of this process and make only them visible.

    Returns ``None`` for ``count == 0`` (nothing to do). Sets
    ``env["CUDA_VISIBLE_DEVICES"]`` (``os.environ`` by default), so call it before
    importing torch or sglang.
    """
    env = os.environ if env is None else env
    if count <= 0:
        return None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        # CUDA read CUDA_VISIBLE_DEVICES when it started: setting it now changes nothing.
        raise GpuSlotError("CUDA was initialised before the GPU slot lock was taken")
    preset = env.get(VISIBLE_ENV)
    if preset is not None:
        candidates = parse_visible(preset)
        if len(candidates) < count:
            raise GpuSlotError(
                f"this job needs {count} GPU(s) but {VISIBLE_ENV}={preset!r} "
                f"names {len(candidates)}"
            )
        if len(candidates) == count:
            # Exactly the job's share: a scheduler (SLURM --gpus, k8s) assigned them.
            log.info("using GPUs %s assigned by the scheduler (%s)", preset, VISIBLE_ENV)
            lease = GpuLease(tuple(candidates), assigned_by_scheduler=True, count=count)
            _HELD.append(lease)
            return lease
        # More than the job needs (e.g. a run restricted with an exported
        # CUDA_VISIBLE_DEVICES): share them between jobs by lock, like all GPUs.
    else:
        total = detect_gpu_count(env) if total is None else total
        if total < count:
            raise GpuSlotError(
                f"this job needs {count} GPU(s) but this machine has {total} "
                f"(from config gpus.count or nvidia-smi -L)"
            )
        candidates = [str(gpu) for gpu in range(total)]
    directory = Path(lock_dir or env.get(LOCK_DIR_ENV) or DEFAULT_LOCK_DIR)
    directory.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    while True:
        files = _try_lock(directory, candidates, count)
        if files is not None:
            ids = tuple(gpu for gpu, _ in files)
            lease = GpuLease(
                ids, assigned_by_scheduler=False, count=count, _files=[fh for _, fh in files]
            )
            _HELD.append(lease)
            env[VISIBLE_ENV] = ",".join(ids)
            log.info("took GPU slot(s) %s (locks in %s)", ",".join(ids), directory)
            return lease
        if time.monotonic() >= deadline:
            raise GpuSlotTimeout(
                f"waited {timeout_s:.0f} s for {count} of {len(candidates)} GPUs and they "
                f"stayed taken ({_holders(directory, candidates)}). Is another run using "
                f"them? Bound concurrency with `snakemake --resources gpu={len(candidates)}`, "
                f"or raise gpus.lock_timeout_s."
            )
        time.sleep(poll_s)


def _try_lock(
    directory: Path, candidates: Sequence[str], count: int
) -> list[tuple[str, IO[str]]] | None:
    """Lock ``count`` free GPUs, or none at all (never hold some while waiting:
    two jobs each holding half of what they need would wait for ever).

    Lock files are named by the id CUDA knows the GPU by, so runs that see
    different subsets of the machine's GPUs still exclude each other.
    """
    taken: list[tuple[str, IO[str]]] = []
    for gpu in candidates:
        fh = open(directory / f"gpu-{gpu}.lock", "a+")  # noqa: SIM115 (kept open: it is the lock)
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            fh.close()
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                continue
            raise
        # Who holds it, for the timeout message of the jobs that wait.
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()}\n")
        fh.flush()
        taken.append((gpu, fh))
        if len(taken) == count:
            return taken
    for _, fh in taken:
        fh.close()
    return None


def _holders(directory: Path, candidates: Sequence[str]) -> str:
    parts = []
    for gpu in candidates:
        try:
            pid = (directory / f"gpu-{gpu}.lock").read_text().strip() or "?"
        except OSError:
            pid = "?"
        parts.append(f"GPU {gpu}: pid {pid}")
    return ", ".join(parts)


@dataclass(frozen=True)
class GpuRequest:
    """The GPUs one job needs, and how long it may wait for them."""

    count: int
    machine_gpus: int | None = None  # None: detect (nvidia-smi -L)
    timeout_s: float = from_schema("gpus", "lock_timeout_s")

    @classmethod
    def of_job(cls, snakemake: Any) -> Self:
        """A Snakemake script job's request: ``resources.gpu`` GPUs; machine size and
        timeout from the ``gpus`` config section (how to run, so not a rule param)."""
        settings = snakemake.config["gpus"]  # validated: the schema's defaults are in
        total = settings["count"]
        return cls(
            count=int(getattr(snakemake.resources, "gpu", 0) or 0),
            machine_gpus=None if total == "auto" else int(total),
            timeout_s=float(settings["lock_timeout_s"]),
        )

    def acquire(self) -> GpuLease | None:
        return acquire_gpus(self.count, total=self.machine_gpus, timeout_s=self.timeout_s)
