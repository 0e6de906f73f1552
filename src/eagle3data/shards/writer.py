"""Writing a shard: :class:`ShardWriter`, atomically (the file appears whole or not at all),
appending or streaming, with the disk kept busy while the job computes."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Self

import h5py
import numpy as np

from ..atomic import atomic_path
from ..checks import positive_int
from ..errors import ShardFormatError
from .encoding import (
    check_shape,
    checked_loss_mask,
    checked_token_ids,
    nonfinite_rows,
    to_fp8,
    to_storage,
)
from .format import (
    ENCODINGS,
    FORMAT_NAME,
    FORMAT_VERSION,
    FP8_BLOCK_SIZE,
    FP8_DTYPE,
    FP8_GRANULARITY,
    HIDDEN,
    PLAIN_VERSION,
    RESERVED_ATTRS,
    SCALE_DTYPE,
    SCALE_SUFFIX,
    STORAGE_DTYPES,
    HiddenDtype,
    StorageDtype,
    check_hidden_dtype,
    encode_attrs,
    num_blocks,
)

if TYPE_CHECKING:
    import torch

# Only filters built into every HDF5, so any reader can decode without plugins.
_COMPRESSIONS = (None, "gzip", "lzf")
# ~1 MiB chunks: large enough for streaming throughput, small enough for HDF5's default chunk cache.
_CHUNK_BYTES = 1 << 20
# Start writing a shard back to disk every this many bytes (see _FlushBehind).
_FLUSH_BEHIND_BYTES = 64 << 20


class ShardWriter:
    """Writes one shard; the file appears at ``path`` only on a clean exit.

    Two ways to fill it. Appending, in shard order::

        with ShardWriter(path, hidden_size=H, hidden_dtype="bfloat16", attrs=attrs) as w:
            w.add(sample_id, input_ids, loss_mask, aux, last)

    Or streaming, when all samples and their lengths are known up front (the
    extraction job): declare them, then write each sample's hidden states in any
    order, e.g. as length-sorted batches finish. Rows go straight to their
    final offsets, so memory never holds more than the caller's batch::

        with ShardWriter(path, hidden_size=H, hidden_dtype="bfloat16", attrs=attrs) as w:
            w.declare_samples(sample_ids, input_ids, loss_masks)
            w.write_states(i, aux, last)  # once per sample, any order

    Both produce the same format; a reader cannot tell them apart.

    ``hidden_dtype`` is the forward dtype: states are cast to it (nearest even), and
    readers return it. ``storage_dtype`` (default: the same) may be ``"float8_e4m3fn"``:
    the states in ``hidden_dtype`` are then stored as scaled float8 (module docstring),
    one float32 scale per token per ``scale_block_size`` channels of each layer.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        hidden_size: int,
        hidden_dtype: HiddenDtype,
        attrs: Mapping[str, Any],
        compression: str | None = None,
        storage_dtype: StorageDtype | None = None,
        scale_block_size: int = FP8_BLOCK_SIZE,
    ) -> None:
        hidden_size = positive_int(hidden_size, "hidden_size")
        check_hidden_dtype(hidden_dtype)
        storage_dtype = hidden_dtype if storage_dtype in (None, "auto") else storage_dtype
        if storage_dtype not in (hidden_dtype, FP8_DTYPE):
            raise ValueError(
                f"storage_dtype must be the hidden_dtype ({hidden_dtype!r}) or "
                f"{FP8_DTYPE!r}, got {storage_dtype!r}"
            )
        scale_block_size = positive_int(scale_block_size, "scale_block_size")
        compression = None if compression == "none" else compression
        if compression not in _COMPRESSIONS:
            raise ValueError(
                f"compression must be one of {['none', *_COMPRESSIONS[1:]]}, got {compression!r}"
            )
        reserved = sorted(RESERVED_ATTRS.intersection(attrs))
        if reserved:
            raise ValueError(f"attrs {reserved} are written by the shard module; do not pass them")

        self.path = Path(path)
        self.hidden_size = hidden_size
        self.hidden_dtype: HiddenDtype = hidden_dtype
        self.storage_dtype: StorageDtype = storage_dtype
        self.scaled = storage_dtype == FP8_DTYPE
        self.scale_block_size = min(scale_block_size, hidden_size)
        self.compression = compression
        # Encode now so an unstorable attr fails before any file is created.
        self._attrs = encode_attrs(attrs)
        self._file: h5py.File | None = None
        self._stack: ExitStack | None = None
        self._used = False
        self._mode: Literal["append", "declared"] | None = None
        self._offsets: list[int] = [0]
        self._ids: list[str] = []
        self._seen: set[str] = set()
        self._written: np.ndarray = np.zeros(0, dtype=bool)  # declared mode: states written
        # aux, last (and their scales, when scaled), looked up once.
        self._hidden_datasets: tuple[h5py.Dataset, ...] | None = None
        self._flush: _FlushBehind

    @property
    def num_samples(self) -> int:
        return len(self._ids)

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    def __enter__(self) -> Self:
        if self._used:
            raise RuntimeError("a ShardWriter can only be used once")
        self._used = True
        with ExitStack() as stack:
            # atomic_path: hidden '.<name>.*.tmp' file, fsync, rename, directory fsync.
            tmp = stack.enter_context(atomic_path(self.path))
            f = stack.enter_context(h5py.File(tmp, "w"))
            # Registered after the file, so it stops (and the fd stays open) before the close.
            self._flush = _FlushBehind(f.id.get_vfd_handle(), _FLUSH_BEHIND_BYTES)
            stack.callback(self._flush.close)
            self._write_header(f)
            self._stack = stack.pop_all()
        self._file = f
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        f, stack = self._file, self._stack
        self._file = self._stack = None
        self._hidden_datasets = None
        assert f is not None and stack is not None
        if exc_type is not None:
            # Closes the HDF5 file, then atomic_path deletes the temp file; `path` is untouched.
            stack.__exit__(exc_type, exc, tb)
            return
        # Any failure while finishing also goes through the stack, so it too leaves no file.
        with stack:
            self._write_index(f)

    def add(
        self,
        sample_id: str,
        input_ids: np.ndarray | torch.Tensor,
        loss_mask: np.ndarray | torch.Tensor,
        aux_hidden_states: np.ndarray | torch.Tensor,
        last_hidden_states: np.ndarray | torch.Tensor,
    ) -> None:
        """Append one conversation; hidden states are cast to ``hidden_dtype`` (nearest even)."""
        f = self._open_file("add")
        if self._mode == "declared":
            raise RuntimeError("add() cannot follow declare_samples(); use write_states()")
        if self._mode is None:
            self._mode = "append"
            self._create_append_layout(f)
        ids, mask = self._checked_tokens(sample_id, input_ids, loss_mask)
        states = self._checked_states(sample_id, len(ids), aux_hidden_states, last_hidden_states)
        start, stop = self._offsets[-1], self._offsets[-1] + len(ids)
        for name, data in (("input_ids", ids), ("loss_mask", mask), *states.items()):
            ds = f[name]
            ds.resize(stop, axis=0)
            ds[start:stop] = data
        self._flush.wrote(sum(a.nbytes for a in states.values()))
        self._offsets.append(stop)
        self._ids.append(sample_id)
        self._seen.add(sample_id)

    def declare_samples(
        self,
        sample_ids: Sequence[str],
        input_ids: Sequence[Sequence[int] | np.ndarray | torch.Tensor],
        loss_masks: Sequence[Sequence[int] | np.ndarray | torch.Tensor],
    ) -> None:
        """Fix the shard's samples, in shard order, before any hidden state is written.

        Writes token ids, loss masks and offsets now and allocates the hidden-state
        rows; :meth:`write_states` then fills each sample's rows. The shard is only
        published if every declared sample got its states.
        """
        f = self._open_file("declare_samples")
        if self._mode is not None:
            raise RuntimeError("declare_samples() can be called once, before any add()")
        if not len(sample_ids) == len(input_ids) == len(loss_masks):
            raise ValueError(
                f"{len(sample_ids)} sample ids, {len(input_ids)} input_ids and "
                f"{len(loss_masks)} loss masks: expected one of each per sample"
            )
        tokens, masks = [], []
        try:
            for sid, ids, mask in zip(sample_ids, input_ids, loss_masks, strict=True):
                ids_arr, mask_arr = self._checked_tokens(sid, ids, mask)
                tokens.append(ids_arr)
                masks.append(mask_arr)
                self._seen.add(sid)
        except ShardFormatError:
            self._seen.clear()  # nothing was declared; the caller may fix and retry
            raise
        self._mode = "declared"
        self._ids = list(sample_ids)
        self._offsets = [0, *np.cumsum([len(t) for t in tokens]).tolist()]
        self._written = np.zeros(len(self._ids), dtype=bool)
        if not self._ids:
            self._create_append_layout(f)  # an empty shard looks the same either way
            return
        total = self.num_tokens
        self._create_fixed(f, "input_ids", np.concatenate(tokens))
        self._create_fixed(f, "loss_mask", np.concatenate(masks))
        for name, (dtype, width) in self._hidden_layout().items():
            self._create_fixed(f, name, (total, width), dtype)
        # Looked up once: a lookup by name costs about as much as writing a short sample.
        self._hidden_datasets = tuple(f[name] for name in self._hidden_layout())

    def write_states(
        self,
        index: int,
        aux_hidden_states: np.ndarray | torch.Tensor,
        last_hidden_states: np.ndarray | torch.Tensor,
    ) -> None:
        """Store the hidden states of declared sample ``index`` (shard order) at its rows."""
        self._open_file("write_states")
        if self._mode != "declared":
            raise RuntimeError("write_states() needs declare_samples() first")
        if not 0 <= index < len(self._ids):
            raise IndexError(f"sample index {index} out of range for {len(self._ids)} samples")
        sample_id = self._ids[index]
        if self._written[index]:
            raise ShardFormatError(f"sample {sample_id!r}: hidden states written twice")
        start, stop = self._offsets[index], self._offsets[index + 1]
        states = self._checked_states(
            sample_id, stop - start, aux_hidden_states, last_hidden_states
        )
        assert self._hidden_datasets is not None
        for ds, data in zip(self._hidden_datasets, states.values(), strict=True):
            ds[start:stop] = data
        self._flush.wrote(sum(a.nbytes for a in states.values()))
        self._written[index] = True

    def _open_file(self, method: str) -> h5py.File:
        if self._file is None:
            raise RuntimeError(f"ShardWriter.{method}() must be called inside its `with` block")
        return self._file

    def _checked_tokens(
        self, sample_id: Any, input_ids: Any, loss_mask: Any
    ) -> tuple[np.ndarray, np.ndarray]:
        if not isinstance(sample_id, str) or not sample_id:
            raise ShardFormatError(f"sample id must be a non-empty string, got {sample_id!r}")
        if sample_id in self._seen:
            raise ShardFormatError(f"sample {sample_id!r}: duplicate sample id in this shard")
        ids = checked_token_ids(input_ids, sample_id)
        return ids, checked_loss_mask(loss_mask, sample_id, ids.shape[0])

    def _checked_states(
        self, sample_id: str, num_tokens: int, aux_hidden_states: Any, last_hidden_states: Any
    ) -> dict[str, np.ndarray]:
        """What goes on disk, by dataset name, in the order of :meth:`_hidden_layout`."""
        h = self.hidden_size
        # Check shapes before casting: the cast may be a large device-to-host copy.
        check_shape(aux_hidden_states, (num_tokens, 3 * h), "aux_hidden_states", sample_id, "3H")
        check_shape(last_hidden_states, (num_tokens, h), "last_hidden_states", sample_id, "H")
        out: dict[str, np.ndarray] = {}
        for (name, layers), x in zip(HIDDEN, (aux_hidden_states, last_hidden_states), strict=True):
            if not self.scaled:
                out[name] = to_storage(x, self.hidden_dtype, name, sample_id)
                bad = nonfinite_rows(out[name], self.hidden_dtype)
            else:
                out[name], out[name + SCALE_SUFFIX] = to_fp8(
                    x, self.hidden_dtype, layers, h, self.scale_block_size, name, sample_id
                )
                # A NaN or inf anywhere in a block makes its scale non-finite.
                bad = ~np.isfinite(out[name + SCALE_SUFFIX]).all(axis=1)
            # Fail here rather than in a training job: NaN/inf (e.g. fp16 overflow) is never valid.
            if bad.any():
                raise ShardFormatError(
                    f"sample {sample_id!r}: {name} has non-finite values in "
                    f"{int(bad.sum())} of {num_tokens} rows (as {self.hidden_dtype})"
                )
        return {name: out[name] for name in self._hidden_layout()}

    def _hidden_layout(self) -> dict[str, tuple[np.dtype, int]]:
        """Hidden-state datasets: name -> (dtype, row width)."""
        storage, h = STORAGE_DTYPES[self.storage_dtype], self.hidden_size
        layout = {name: (storage, layers * h) for name, layers in HIDDEN}
        if self.scaled:
            blocks = num_blocks(h, self.scale_block_size)
            for name, layers in HIDDEN:
                layout[name + SCALE_SUFFIX] = (SCALE_DTYPE, layers * blocks)
        return layout

    def _write_header(self, f: h5py.File) -> None:
        f.attrs["format"] = FORMAT_NAME
        f.attrs["format_version"] = FORMAT_VERSION if self.scaled else PLAIN_VERSION
        f.attrs["hidden_dtype"] = self.hidden_dtype
        f.attrs["storage_dtype"] = self.storage_dtype
        f.attrs["hidden_encoding"] = ENCODINGS[self.storage_dtype]
        f.attrs["hidden_size"] = self.hidden_size
        if self.scaled:
            f.attrs["scale_granularity"] = FP8_GRANULARITY
            f.attrs["scale_block_size"] = self.scale_block_size
        f.attrs["compression"] = self.compression or "none"
        for key, value in self._attrs.items():
            f.attrs[key] = value

    def _create_append_layout(self, f: h5py.File) -> None:
        self._create_rows(f, "input_ids", np.dtype(np.int32), ())
        self._create_rows(f, "loss_mask", np.dtype(np.uint8), ())
        for name, (dtype, width) in self._hidden_layout().items():
            self._create_rows(f, name, dtype, (width,))

    def _create_rows(self, f: h5py.File, name: str, dtype: np.dtype, row: tuple[int, ...]) -> None:
        f.create_dataset(
            name,
            shape=(0, *row),
            maxshape=(None, *row),
            chunks=_chunk_shape(dtype, row),
            dtype=dtype,
            compression=self.compression,
            shuffle=self.compression is not None,
        )

    def _create_fixed(
        self,
        f: h5py.File,
        name: str,
        data_or_shape: np.ndarray | tuple[int, ...],
        dtype: np.dtype | None = None,
    ) -> None:
        """A dataset of its final size. Uncompressed ones are contiguous: rows written at
        any offset go straight to their place in the file, with no chunk index."""
        data = data_or_shape if isinstance(data_or_shape, np.ndarray) else None
        shape = data.shape if data is not None else tuple(data_or_shape)
        dtype = data.dtype if data is not None else dtype
        assert dtype is not None
        if self.compression is None:
            # No fill pass: every row is written exactly once (checked at the end).
            f.create_dataset(name, shape=shape, dtype=dtype, data=data, fill_time="never")
            return
        f.create_dataset(
            name,
            shape=shape,
            dtype=dtype,
            data=data,
            # HDF5 wants fixed-size chunks no longer than the dataset.
            chunks=(min(shape[0], _chunk_shape(dtype, shape[1:])[0]), *shape[1:]),
            compression=self.compression,
            shuffle=True,
        )

    def _write_index(self, f: h5py.File) -> None:
        if self._mode is None:  # an empty shard
            self._create_append_layout(f)
        missing = np.flatnonzero(~self._written)
        if self._mode == "declared" and missing.size:
            names = ", ".join(repr(self._ids[i]) for i in missing[:5])
            raise ShardFormatError(
                f"{self.path}: hidden states of {missing.size} declared sample(s) were never "
                f"written ({names}{', ...' if missing.size > 5 else ''})"
            )
        # Written last: these are small, and their presence marks the shard as finished.
        f.create_dataset("sample_offsets", data=np.asarray(self._offsets, dtype=np.int64))
        f.create_dataset(
            "sample_ids",
            data=np.asarray(self._ids, dtype=object),
            dtype=h5py.string_dtype("utf-8"),
        )
        f.attrs["num_samples"] = len(self._ids)
        f.attrs["num_tokens"] = self._offsets[-1]


class _FlushBehind:
    """Hands written bytes to the disk in the background while more are being written.

    Otherwise the kernel keeps the whole shard dirty in RAM (GBs) and the final fsync
    writes all of it while the job waits; this way the disk works while the job
    computes, and the final fsync only has the tail left.
    """

    def __init__(self, fd: Any, every_bytes: int) -> None:
        self._fd = fd if isinstance(fd, int) else None  # only for the default (POSIX) driver
        self._every = every_bytes
        self._unflushed = 0
        self._pool: ThreadPoolExecutor | None = None
        self._future: Future[None] | None = None

    def wrote(self, nbytes: int) -> None:
        self._unflushed += nbytes
        if self._fd is None or self._unflushed < self._every:
            return
        if self._future is not None:
            if not self._future.done():
                return  # the disk is still busy with the previous flush
            self._future.result()  # an I/O error fails the shard here
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-flush")
        self._unflushed = 0
        self._future = self._pool.submit(_datasync, self._fd)

    def close(self) -> None:
        """Wait for the flush in flight (the file must outlive it); raise its error."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._future is not None:
            self._future.result()


def _datasync(fd: int) -> None:
    getattr(os, "fdatasync", os.fsync)(fd)  # macOS has no fdatasync


def _chunk_shape(dtype: np.dtype, row: tuple[int, ...]) -> tuple[int, ...]:
    row_bytes = dtype.itemsize * int(np.prod(row, dtype=np.int64))
    return (max(1, _CHUNK_BYTES // row_bytes), *row)
