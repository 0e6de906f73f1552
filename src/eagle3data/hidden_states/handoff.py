"""Hidden-state rows from SGLang's worker processes to the shard writer, as raw bytes.

SGLang's own way out (``return_hidden_states``) turns every value into a Python float
(``.tolist()``), pickles it across two processes and we rebuild a tensor from the lists:
about 120 tokens/s at Kimi-K2.5's width on one core (notes/sglang.md 5.1), far below what
8 GPUs prefill. Here the capture hook copies each forward batch's ``[T, 4H]`` rows once
into a file in shared memory (``/dev/shm``, a tmpfs: the copy is a memcpy, nothing reaches
a disk) and hands SGLang a ``[T, 3]`` *pointer* tensor instead: (worker, batch number, row) per
token. SGLang slices and returns the pointers exactly as it would the states (one row per
prompt token, per request), so its own bookkeeping still decides which rows belong to
which request, and our process maps the file and takes the rows as tensor views: no
serialisation, no per-value work, one copy on each side. With several ranks, a pointer is
(worker pid, batch number, row): the first rank of each attention tensor-parallel group
writes the batches its group computed (:class:`RowsWriter`).

No library does this: SGLang has no tensor-returning capture API in a released version
(SpecForge patches SGLang or drives its model runner directly, both tied to one SGLang
version's internals), and shared-memory transports (torch.multiprocessing, Ray's object
store) need both ends to be ours. The hook sees only the logits processor's output, which
is stable across 0.5.x (the ``forward_hooks`` server argument has been there since 0.5.0).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..atomic import pid_alive
from ..errors import SGLangCaptureError
from ..servers.processes import Worker

DIR_PREFIX = "eagle3data-capture-"
_SHM = Path("/dev/shm")

# numpy has no bfloat16: its rows are mapped as int16 and viewed as bfloat16 in torch.
_NUMPY_STANDIN = {
    torch.bfloat16: np.int16,
    torch.float16: np.float16,
    torch.float32: np.float32,
}


def default_root() -> Path:
    """``/dev/shm`` (memory) where it exists and is writable, else the temp directory."""
    if _SHM.is_dir() and os.access(_SHM, os.W_OK | os.X_OK):
        return _SHM
    return Path(tempfile.gettempdir())


def remove_stale_dirs(root: Path) -> list[Path]:
    """Remove hand-off directories left by capture jobs that were killed (their pid is
    gone): on a tmpfs they would hold memory until the machine reboots."""
    removed = []
    for path in root.glob(f"{DIR_PREFIX}*"):
        pid = path.name[len(DIR_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def make_dir(root: str | Path | None = None) -> Path:
    """A fresh hand-off directory for one engine, named after this process."""
    base = Path(root) if root not in (None, "auto") else default_root()
    if not base.is_dir():
        raise SGLangCaptureError(
            f"hidden_states.sglang.handoff_dir {str(base)!r} is not a directory"
        )
    remove_stale_dirs(base)
    return Path(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-", dir=base))


def check_room(directory: Path, needed_bytes: int, what: str) -> None:
    """Fail before a worker would: a write past a full tmpfs kills it with SIGBUS."""
    usage = shutil.disk_usage(directory)
    if usage.free < needed_bytes:
        raise SGLangCaptureError(
            f"{directory} has {usage.free / 2**20:,.0f} MiB free; the SGLang capture hands "
            f"{what} ({needed_bytes / 2**20:,.0f} MiB) to this job through it. Give the "
            f"machine or container more shared memory (docker run --shm-size), lower "
            f"hidden_states.batch_tokens, or set hidden_states.sglang.handoff_dir to a "
            f"larger tmpfs or a local disk"
        )


def _batch_path(directory: str | Path, writer: int, batch: int) -> Path:
    return Path(directory) / f"{writer}-{batch:08d}.rows"


def _rank_path(directory: str | Path, pid: int) -> Path:
    return Path(directory) / f"{pid}.rank.json"


def write_rows(path: Path, parts: Sequence[torch.Tensor]) -> None:
    """Write the column blocks ``parts`` (``[T, w_i]`` each, any device, one dtype) side by
    side as ``[T, sum w_i]`` rows into a new file at ``path``: each block goes straight
    from the device into the shared mapping, never joined on the device first."""
    tokens, dtype = parts[0].shape[0], parts[0].dtype
    width = sum(p.shape[1] for p in parts)
    nbytes = tokens * width * parts[0].element_size()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        if nbytes:
            shared = mmap.mmap(fd, nbytes)
            target = torch.frombuffer(shared, dtype=dtype).view(tokens, width)
            start = 0
            for part in parts:
                target[:, start : start + part.shape[1]].copy_(part)
                start += part.shape[1]
            # The mapping closes when the last view of it is gone.
            del target, shared
    finally:
        os.close(fd)


@dataclass(frozen=True)
class WorkerRank:
    """Where one SGLang worker process sits in the engine's parallel layout.

    The rows of a forward batch are replicated across an attention tensor-parallel group
    (every rank of it holds the whole ``[T, 4H]`` after the all-reduce); different groups
    (data-parallel attention, data-parallel replicas) compute different requests. So the
    first rank of each group writes, and the others write nothing.
    """

    pid: int
    label: str  # SGLang's own name for the process, e.g. "scheduler DP1 TP1"
    attn_tp_rank: int  # rank within the group that holds the same rows

    @property
    def writes(self) -> bool:
        return self.attn_tp_rank == 0

    @classmethod
    def of_this_process(cls) -> WorkerRank:
        return cls(os.getpid(), _process_title(), _attention_tp_rank())


def _process_title() -> str:
    """SGLang's title of this worker (``sglang::scheduler_TP1_EP1``) as ``scheduler TP1 EP1``."""
    try:
        title = Path("/proc/self/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        title = ""
    return Worker(os.getpid(), 0, title).name if title.startswith("sglang::") else "worker"


def _attention_tp_rank() -> int:
    """This worker's rank within its attention tensor-parallel group: SGLang 0.5.23's
    parallel context; where that is not available (not an SGLang worker), the process
    group's rank."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().attn_tp_rank)
    except (ImportError, AttributeError, RuntimeError, ValueError):
        dist = torch.distributed
        initialized = dist.is_available() and dist.is_initialized()
        return dist.get_rank() if initialized else 0


# Pointers travel as float32 (SGLang returns them as it returns states): exact for
# integers below 2**24, which Linux pids (at most 2**22), batch numbers and rows stay under.
_EXACT_FLOAT32 = 2**24


class RowsWriter:
    """Worker side, in SGLang's forward hook: stores a batch's rows, returns its pointers.

    Every worker runs the hook. The first rank of each attention tensor-parallel group
    writes its batches under its own pid (so groups that compute different requests,
    with data-parallel attention, never collide); the others, whose rows are replicas,
    write nothing and return pointers of the same shape, which SGLang drops (only a
    group's first rank sends results back). Each worker records its rank once
    (``{pid}.rank.json``), so the job can say who wrote what.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._next_batch = 0
        self._rank: WorkerRank | None = None

    def put(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Store one forward batch's rows, given as column blocks (``[aux | last]``)."""
        rank = self._rank or self._record_rank()
        batch = self._next_batch
        self._next_batch += 1
        if rank.writes:
            write_rows(_batch_path(self.directory, rank.pid, batch), parts)
        tokens, device = parts[0].shape[0], parts[0].device
        pointers = torch.empty((tokens, 3), dtype=torch.float32, device=device)
        pointers[:, 0] = rank.pid
        pointers[:, 1] = batch
        pointers[:, 2] = torch.arange(tokens, device=device)
        return pointers

    def _record_rank(self) -> WorkerRank:
        rank = WorkerRank.of_this_process()
        if rank.pid >= _EXACT_FLOAT32:
            raise SGLangCaptureError(f"pid {rank.pid} does not fit a float32 pointer")
        path = _rank_path(self.directory, rank.pid)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**asdict(rank), "writes": rank.writes}))
        os.replace(tmp, path)
        self._rank = rank
        return rank


@dataclass
class WriterCount:
    """What one worker handed over in this job."""

    rank: WorkerRank
    batches: set[int] = field(default_factory=set)
    rows: int = 0


class RowsReader:
    """Our side: resolves the pointers SGLang returned into views of the mapped rows."""

    def __init__(self, directory: str | Path, width: int, dtype: torch.dtype) -> None:
        self.directory = Path(directory)
        self.width = width
        self.dtype = dtype
        self._mapped: dict[tuple[int, int], torch.Tensor] = {}
        self.writers: dict[int, WriterCount] = {}

    def rows(self, pointers: list[list[float]], length: int) -> torch.Tensor:
        """The ``[length, width]`` rows of one request (a view into shared memory)."""
        p = np.asarray(pointers, dtype=np.float64)
        if p.shape != (length, 3):
            raise SGLangCaptureError(
                f"SGLang returned hidden-state pointers of shape {list(p.shape)} for a "
                f"{length}-token sample; expected [{length}, 3]: is the forward hook "
                f"registered (hidden_states.sglang.handoff shared_memory)?"
            )
        writer, batch, first = int(p[0, 0]), int(p[0, 1]), int(p[0, 2])
        expected = np.stack(
            [np.full(length, writer), np.full(length, batch), first + np.arange(length)], axis=1
        ).astype(np.float64)
        if not np.array_equal(p, expected):
            raise SGLangCaptureError(
                f"SGLang returned pointers that are not one forward batch's consecutive rows "
                f"for a {length}-token sample (starting at worker {writer} batch {batch}, "
                f"row {first}): was the prompt split (chunked prefill) or partly cached "
                f"(radix cache)?"
            )
        mapped = self._map(writer, batch)
        if first + length > mapped.shape[0]:
            raise SGLangCaptureError(
                f"batch {batch} of worker {writer} holds {mapped.shape[0]} rows; a sample "
                f"points at rows {first}-{first + length - 1}"
            )
        count = self.writers[writer]
        count.batches.add(batch)
        count.rows += length
        return mapped[first : first + length]

    def _writer(self, pid: int) -> WriterCount:
        if pid not in self.writers:
            try:
                info = json.loads(_rank_path(self.directory, pid).read_text())
            except FileNotFoundError:
                raise SGLangCaptureError(
                    f"SGLang returned rows of worker pid {pid}, which never ran the capture "
                    f"hook in {self.directory}"
                ) from None
            rank = WorkerRank(pid, info["label"], info["attn_tp_rank"])
            if not rank.writes:
                raise SGLangCaptureError(
                    f"SGLang returned rows of {rank.label} (pid {pid}), a rank that holds "
                    f"replicas and writes none: the results of another rank of its "
                    f"attention tensor-parallel group were expected"
                )
            self.writers[pid] = WriterCount(rank)
        return self.writers[pid]

    def _map(self, writer: int, batch: int) -> torch.Tensor:
        key = (writer, batch)
        if key in self._mapped:
            return self._mapped[key]
        self._writer(writer)
        path = _batch_path(self.directory, writer, batch)
        standin = np.dtype(_NUMPY_STANDIN[self.dtype])
        row_bytes = self.width * standin.itemsize
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise SGLangCaptureError(
                f"SGLang pointed at batch {batch} of worker pid {writer}, but {path} does "
                f"not exist: that worker did not write it"
            ) from None
        if size % row_bytes:
            raise SGLangCaptureError(
                f"{path} holds {size} bytes, not whole rows of {self.width} {self.dtype} "
                f"values: the engine's dtype or width is not the one expected"
            )
        if size == 0:
            rows = torch.empty((0, self.width), dtype=self.dtype)
        else:
            # Copy-on-write: writable for torch (no warning), never written, never copied.
            array = np.memmap(path, dtype=standin, mode="c", shape=(size // row_bytes, self.width))
            rows = torch.from_numpy(array).view(self.dtype)
        self._mapped[key] = rows
        return rows

    def workers(self) -> list[WorkerRank]:
        """Every worker that ran the hook so far, writers and replicas."""
        ranks = []
        for path in sorted(self.directory.glob("*.rank.json")):
            info = json.loads(path.read_text())
            ranks.append(WorkerRank(info["pid"], info["label"], info["attn_tp_rank"]))
        return ranks

    def summary(self) -> str:
        """Who handed over what, for the job's log: one entry per worker."""
        parts = []
        for rank in self.workers():
            count = self.writers.get(rank.pid)
            if count is not None:
                batches = len(count.batches)
                parts.append(
                    f"{rank.label} (pid {rank.pid}) wrote {batches} "
                    f"batch{'' if batches == 1 else 'es'}, {count.rows:,} rows"
                )
            elif rank.writes:
                parts.append(f"{rank.label} (pid {rank.pid}) wrote no rows that were read")
            else:
                parts.append(f"{rank.label} (pid {rank.pid}) holds replicas, wrote none")
        return "; ".join(parts) or "no worker ran the capture hook"

    def release(self) -> None:
        """Unlink every batch file: their memory returns once the rows' last view is gone
        (the shard writer holds them until they are on disk). A file of a rank that holds
        replicas means rows were written twice: refused."""
        self._mapped.clear()
        replicas = {rank.pid: rank for rank in self.workers() if not rank.writes}
        twice = []
        for path in self.directory.glob("*.rows"):
            writer = int(path.name.split("-", 1)[0])
            if writer in replicas:
                twice.append(replicas[writer])
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        if twice:
            rank = twice[0]
            raise SGLangCaptureError(
                f"{rank.label} (pid {rank.pid}) wrote rows that the first rank of its "
                f"attention tensor-parallel group writes: every row must be written once"
            )


def rows_nbytes(tokens: int, width: int, dtype: torch.dtype) -> int:
    return tokens * width * torch.empty((), dtype=dtype).element_size()
