"""The EAGLE-3 hidden-state shard format: the one module that writes, reads and checks it.

One HDF5 file per shard. The tokens of all conversations are concatenated, so no
padding is stored; ``sample_offsets`` says where each conversation starts.

=====================  ==========  ==============================================
dataset                shape       dtype
=====================  ==========  ==============================================
``input_ids``          [T]         int32
``loss_mask``          [T]         uint8 (0 or 1)
``aux_hidden_states``  [T, 3H]     hidden dtype (see encoding below); the three
                                   aux layers concatenated in increasing order
``last_hidden_states`` [T, H]      hidden dtype; final layer *after* the final
                                   norm, i.e. the lm_head input
``sample_offsets``     [N+1]       int64; conversation i is rows
                                   ``offsets[i]:offsets[i+1]``
``sample_ids``         [N]         variable-length UTF-8 strings
=====================  ==========  ==============================================

Root attributes: ``format`` = ``"eagle3-hidden-states"``, ``format_version`` (1, or
2 for scaled float8 storage, below), ``hidden_dtype`` (the forward dtype: what readers
return), ``storage_dtype``, ``hidden_encoding``, ``hidden_size``, ``compression``,
``num_samples``, ``num_tokens``, plus the caller's provenance (model, tokenizer hash, aux layer ids
in both conventions, ...). Lists are stored as arrays; dicts as JSON strings,
whose keys are listed in the ``json_attrs`` attribute.

Hidden-state encoding (``hidden_encoding``); ``storage_dtype`` is ``hidden_dtype``
except for float8 (it is absent from shards written before it existed):

* float16 / float32: ``"native"`` HDF5 floats.
* bfloat16: HDF5 has no bfloat16 type, so the raw bits are stored as uint16
  (``"bfloat16-bits-as-uint16"``). Reading them back without this module::

      u16 = f["aux_hidden_states"][:]  # uint16 bit patterns
      x = (u16.astype(np.uint32) << 16).view(np.float32)  # numpy, exact
      t = torch.from_numpy(u16.view(np.int16)).view(torch.bfloat16)  # torch, bit-exact

* ``storage_dtype = "float8_e4m3fn"`` (format version 2, half the bytes of bf16, lossy):
  ``"scaled-float8_e4m3fn-bits-as-uint8"``. Each state is split, per token, into
  blocks of ``scale_block_size`` (128) channels inside each layer (aux: each of the
  three H-wide layers on its own; the last block of a layer is shorter when the block
  size does not divide H), ``scale_granularity = "token_block"``. A block is stored as
  float8 e4m3fn bits (uint8) of ``x / scale`` with ``scale = amax(|x|) / 448`` (1 for an
  all-zero block) in float32 datasets ``aux_hidden_states_scale`` [T, 3 * ceil(H / B)]
  and ``last_hidden_states_scale`` [T, ceil(H / B)]. Reading without this module::

      u8, scale = f["aux_hidden_states"][:], f["aux_hidden_states_scale"][:]
      x8 = torch.from_numpy(u8).view(torch.float8_e4m3fn).float()  # [T, 3H]
      B, h = f.attrs["scale_block_size"], f.attrs["hidden_size"]
      widths = [min(B, h - j) for j in range(0, h, B)] * 3  # * 1 for last_hidden_states
      x = x8 * torch.from_numpy(scale).repeat_interleave(torch.tensor(widths), dim=1)
      x = x.to(torch.bfloat16)  # hidden_dtype: what this module returns

  Scales are per token because hidden states carry a few massive-activation channels
  (~25000 against a median of 2 in SmolLM2's middle layers) and per block because
  the block's largest value is stored exactly (see BENCHMARKS.md).

Version 1 readers refuse version 2 shards (they would misread the uint8 bits), and
this module writes version 1 whenever the storage is not float8, so older readers
keep reading those.

Compression (``compression`` = ``"none"``, ``"lzf"`` or ``"gzip"``; shards written
before this attribute existed are uncompressed) uses only filters built into
h5py, with byte shuffling, so every reader decodes it transparently. Uncompressed
shards written by streaming extraction store hidden states contiguously (no chunk
index); appended ones in ~1 MiB chunks. Readers need not care which.

Shards are written to a hidden temp file next to the target and renamed into
place only when complete, so a file at the final path is always a whole shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Self

import h5py
import numpy as np

from .atomic import atomic_path
from .checks import positive_int
from .errors import ShardFormatError

if TYPE_CHECKING:
    import torch

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "FORMAT_VERSIONS",
    "FP8_BLOCK_SIZE",
    "FP8_DTYPE",
    "HiddenDtype",
    "Shard",
    "ShardCheck",
    "ShardFormatError",
    "ShardWriter",
    "StorageDtype",
    "bytes_per_token",
    "file_sha256",
    "open_shard",
    "validate_shard",
]

FORMAT_NAME = "eagle3-hidden-states"
#: The newest version this module reads and writes; it reads every one of FORMAT_VERSIONS.
FORMAT_VERSION = 2
FORMAT_VERSIONS = (1, 2)
# Written unless the shard needs version 2 (scaled float8 storage).
_PLAIN_VERSION = 1

HiddenDtype = Literal["bfloat16", "float16", "float32"]
StorageDtype = Literal["bfloat16", "float16", "float32", "float8_e4m3fn"]

NATIVE_ENCODING = "native"
BF16_ENCODING = "bfloat16-bits-as-uint16"
FP8_DTYPE = "float8_e4m3fn"
FP8_ENCODING = "scaled-float8_e4m3fn-bits-as-uint8"
#: Channels per float8 scale, inside each layer (see the module docstring).
FP8_BLOCK_SIZE = 128
FP8_GRANULARITY = "token_block"
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_SCALE_DTYPE = np.dtype(np.float32)
_SCALE_SUFFIX = "_scale"

_HIDDEN_DTYPES = ("bfloat16", "float16", "float32")
_STORAGE_DTYPES: dict[str, np.dtype] = {
    "bfloat16": np.dtype(np.uint16),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    FP8_DTYPE: np.dtype(np.uint8),
}
_ENCODINGS = {
    "bfloat16": BF16_ENCODING,
    "float16": NATIVE_ENCODING,
    "float32": NATIVE_ENCODING,
    FP8_DTYPE: FP8_ENCODING,
}

_JSON_ATTRS = "json_attrs"
_RESERVED_ATTRS = frozenset(
    {
        "format",
        "format_version",
        "hidden_dtype",
        "storage_dtype",
        "hidden_encoding",
        "hidden_size",
        "scale_granularity",
        "scale_block_size",
        "compression",
        "num_samples",
        "num_tokens",
        _JSON_ATTRS,
    }
)
# (name, number of H-wide layers it concatenates)
_HIDDEN = (("aux_hidden_states", 3), ("last_hidden_states", 1))
_DATASETS = (
    "input_ids",
    "loss_mask",
    "aux_hidden_states",
    "last_hidden_states",
    "sample_offsets",
    "sample_ids",
)
# Only filters built into every HDF5, so any reader can decode without plugins.
_COMPRESSIONS = (None, "gzip", "lzf")
# ~1 MiB chunks: large enough for streaming throughput, small enough for HDF5's default chunk cache.
_CHUNK_BYTES = 1 << 20
# Start writing a shard back to disk every this many bytes (see _FlushBehind).
_FLUSH_BEHIND_BYTES = 64 << 20
# Rows per read when scanning hidden states, to keep validation memory bounded.
_SCAN_BYTES = 64 << 20
# Cap per-sample messages so one broken shard doesn't produce a million-line report.
_MAX_SAMPLE_ERRORS = 20
_INT32_MAX = np.iinfo(np.int32).max


# --------------------------------------------------------------------------- write side


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
        _check_hidden_dtype(hidden_dtype)
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
        reserved = sorted(_RESERVED_ATTRS.intersection(attrs))
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
        self._attrs = _encode_attrs(attrs)
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
        ids = _token_ids(input_ids, sample_id)
        return ids, _loss_mask(loss_mask, sample_id, ids.shape[0])

    def _checked_states(
        self, sample_id: str, num_tokens: int, aux_hidden_states: Any, last_hidden_states: Any
    ) -> dict[str, np.ndarray]:
        """What goes on disk, by dataset name, in the order of :meth:`_hidden_layout`."""
        h = self.hidden_size
        # Check shapes before casting: the cast may be a large device-to-host copy.
        _check_shape(aux_hidden_states, (num_tokens, 3 * h), "aux_hidden_states", sample_id, "3H")
        _check_shape(last_hidden_states, (num_tokens, h), "last_hidden_states", sample_id, "H")
        out: dict[str, np.ndarray] = {}
        for (name, layers), x in zip(_HIDDEN, (aux_hidden_states, last_hidden_states), strict=True):
            if not self.scaled:
                out[name] = _to_storage(x, self.hidden_dtype, name, sample_id)
                bad = _nonfinite_rows(out[name], self.hidden_dtype)
            else:
                out[name], out[name + _SCALE_SUFFIX] = _to_fp8(
                    x, self.hidden_dtype, layers, h, self.scale_block_size, name, sample_id
                )
                # A NaN or inf anywhere in a block makes its scale non-finite.
                bad = ~np.isfinite(out[name + _SCALE_SUFFIX]).all(axis=1)
            # Fail here rather than in a training job: NaN/inf (e.g. fp16 overflow) is never valid.
            if bad.any():
                raise ShardFormatError(
                    f"sample {sample_id!r}: {name} has non-finite values in "
                    f"{int(bad.sum())} of {num_tokens} rows (as {self.hidden_dtype})"
                )
        return {name: out[name] for name in self._hidden_layout()}

    def _hidden_layout(self) -> dict[str, tuple[np.dtype, int]]:
        """Hidden-state datasets: name -> (dtype, row width)."""
        storage, h = _STORAGE_DTYPES[self.storage_dtype], self.hidden_size
        layout = {name: (storage, layers * h) for name, layers in _HIDDEN}
        if self.scaled:
            blocks = _num_blocks(h, self.scale_block_size)
            for name, layers in _HIDDEN:
                layout[name + _SCALE_SUFFIX] = (_SCALE_DTYPE, layers * blocks)
        return layout

    def _write_header(self, f: h5py.File) -> None:
        f.attrs["format"] = FORMAT_NAME
        f.attrs["format_version"] = FORMAT_VERSION if self.scaled else _PLAIN_VERSION
        f.attrs["hidden_dtype"] = self.hidden_dtype
        f.attrs["storage_dtype"] = self.storage_dtype
        f.attrs["hidden_encoding"] = _ENCODINGS[self.storage_dtype]
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


def bytes_per_token(hidden_size: int, hidden_dtype: str, storage_dtype: str | None = None) -> int:
    """Stored bytes per token, uncompressed: (3H + H) hidden values (+ their float8
    scales) + int32 id + uint8 mask. ``storage_dtype`` defaults to ``hidden_dtype``."""
    _check_hidden_dtype(hidden_dtype)
    hidden_size = positive_int(hidden_size, "hidden_size")
    storage = hidden_dtype if storage_dtype in (None, "auto") else storage_dtype
    if storage not in (hidden_dtype, FP8_DTYPE):
        raise ValueError(
            f"storage_dtype must be {hidden_dtype!r} or {FP8_DTYPE!r}, got {storage!r}"
        )
    scales = 0
    if storage == FP8_DTYPE:
        scales = 4 * _num_blocks(hidden_size, FP8_BLOCK_SIZE) * _SCALE_DTYPE.itemsize
    return 4 * hidden_size * _STORAGE_DTYPES[storage].itemsize + scales + 4 + 1


# --------------------------------------------------------------------------- read side


@dataclass
class Shard:
    """An open shard. Token-level arrays are loaded; hidden states are read on demand."""

    path: Path
    attrs: dict[str, Any]
    input_ids: np.ndarray
    loss_mask: np.ndarray
    sample_offsets: np.ndarray
    sample_ids: list[str]
    _file: h5py.File | None = field(repr=False, compare=False)

    @property
    def hidden_size(self) -> int:
        return int(self.attrs["hidden_size"])

    @property
    def hidden_dtype(self) -> HiddenDtype:
        """The forward dtype: what :meth:`aux_hidden_states` returns as torch."""
        return self.attrs["hidden_dtype"]

    @property
    def storage_dtype(self) -> StorageDtype:
        """How the states are stored (``hidden_dtype``, or ``"float8_e4m3fn"``)."""
        return self.attrs.get("storage_dtype", self.attrs["hidden_dtype"])

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def __len__(self) -> int:
        return self.num_samples

    def aux_hidden_states(
        self, rows: slice | None = None, *, as_torch: bool = False
    ) -> np.ndarray | torch.Tensor:
        """Rows of ``[T, 3H]`` as numpy (bfloat16 decoded exactly to float32) or as torch.

        ``as_torch=True`` returns ``hidden_dtype`` (bfloat16/float16/float32), bit-exact
        and without copying unless the storage is float8; float8 states are dequantized
        (value times its block's scale, rounded to ``hidden_dtype``), as numpy too.
        """
        return self._read_hidden("aux_hidden_states", rows, as_torch)

    def last_hidden_states(
        self, rows: slice | None = None, *, as_torch: bool = False
    ) -> np.ndarray | torch.Tensor:
        """Rows of ``[T, H]``, decoded like :meth:`aux_hidden_states`."""
        return self._read_hidden("last_hidden_states", rows, as_torch)

    def sample(self, i: int) -> dict[str, Any]:
        """Conversation ``i``: its id, tokens, loss mask and hidden states (numpy)."""
        n = self.num_samples
        if not -n <= i < n:
            raise IndexError(f"sample index {i} out of range for {n} samples")
        i %= n
        rows = slice(int(self.sample_offsets[i]), int(self.sample_offsets[i + 1]))
        return {
            "id": self.sample_ids[i],
            "input_ids": self.input_ids[rows],
            "loss_mask": self.loss_mask[rows],
            "aux_hidden_states": self.aux_hidden_states(rows),
            "last_hidden_states": self.last_hidden_states(rows),
        }

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _read_hidden(
        self, name: str, rows: slice | None, as_torch: bool
    ) -> np.ndarray | torch.Tensor:
        if self._file is None:
            raise ValueError(f"shard {self.path} is closed")
        rows = rows if rows is not None else slice(None)
        stored = self._file[name][rows]
        if self.storage_dtype != FP8_DTYPE:
            return _decode_hidden(stored, self.hidden_dtype, as_torch)
        scale = self._file[name + _SCALE_SUFFIX][rows]
        h, block = self.hidden_size, int(self.attrs["scale_block_size"])
        values = _dequantize_fp8(stored, scale, h, block)
        if as_torch:
            import torch

            return torch.from_numpy(values).to(getattr(torch, self.hidden_dtype))
        if self.hidden_dtype == "bfloat16":
            return _round_to_bf16(values)
        return values.astype(_STORAGE_DTYPES[self.hidden_dtype], copy=False)


def open_shard(path: str | Path) -> Shard:
    """Open a shard for reading; raises :class:`ShardFormatError` if it is not a shard of
    a version this module reads (:data:`FORMAT_VERSIONS`).

    This checks the header and layout only; use :func:`validate_shard` for a full check.
    """
    path = Path(path)
    f = h5py.File(path, "r")
    try:
        attrs = _decode_attrs(f.attrs)
        problems = _header_errors(attrs)
        missing = [name for name in _required_datasets(attrs) if name not in f]
        if missing:
            problems.append(f"missing datasets {missing}")
        if problems:
            raise ShardFormatError(f"{path}: not a readable shard: {'; '.join(problems)}")
        return Shard(
            path=path,
            attrs=attrs,
            input_ids=f["input_ids"][()],
            loss_mask=f["loss_mask"][()],
            sample_offsets=f["sample_offsets"][()],
            sample_ids=[str(s) for s in f["sample_ids"].asstr()[()]],
            _file=f,
        )
    except BaseException:
        f.close()
        raise


# --------------------------------------------------------------------------- validation


@dataclass(frozen=True)
class ShardCheck:
    """Outcome of :func:`validate_shard`; ``errors`` is empty for a good shard."""

    path: str
    num_samples: int
    num_tokens: int
    sha256: str
    errors: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.errors


def validate_shard(
    path: str | Path,
    *,
    expected_ids: Sequence[str] | None = None,
    hidden_size: int | None = None,
) -> ShardCheck:
    """Check a shard completely. Never raises for bad content; problems come back as errors."""
    path = Path(path)
    try:
        sha256 = file_sha256(path)
    except OSError as e:
        return ShardCheck(str(path), 0, 0, "", (f"cannot read file: {_one_line(e)}",))
    try:
        f = h5py.File(path, "r")
    except Exception as e:
        return ShardCheck(str(path), 0, 0, sha256, (f"cannot open as HDF5: {_one_line(e)}",))
    with f:
        v = _Validator(f, expected_ids, hidden_size)
        try:
            v.run()
        except Exception as e:  # e.g. a damaged chunk that only fails when read
            v.errors.append(f"error while reading shard: {type(e).__name__}: {_one_line(e)}")
    return ShardCheck(str(path), v.num_samples, v.num_tokens, sha256, tuple(v.errors))


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of the file's bytes, streamed."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


class _Validator:
    def __init__(
        self, f: h5py.File, expected_ids: Sequence[str] | None, hidden_size: int | None
    ) -> None:
        self.f = f
        self.expected_ids = expected_ids
        self.hidden_size = hidden_size
        self.errors: list[str] = []
        self.attrs: dict[str, Any] = {}
        self.num_samples = 0
        self.num_tokens = 0
        self.storage_dtype: str | None = None  # set only when the header describes it well
        self.block: int | None = None  # float8: channels per scale
        self.offsets: np.ndarray | None = None  # set only when offsets are valid
        self.ids: list[str] | None = None

    def run(self) -> None:
        self._check_header()
        if not self._check_layout():
            return  # content checks would only repeat the layout errors
        self._check_offsets()
        self._check_ids()
        self._check_tokens()
        if self.storage_dtype is not None:
            for name, _ in _HIDDEN:
                self._check_rows(name, partial(_nonfinite_rows, storage_dtype=self.storage_dtype))
                if self.storage_dtype == FP8_DTYPE:
                    self._check_rows(name + _SCALE_SUFFIX, _bad_scale_rows)

    def _check_header(self) -> None:
        attrs = self.attrs = _decode_attrs(self.f.attrs)
        self.errors.extend(_header_errors(attrs))
        storage = _storage_of(attrs)
        if storage is not None:
            self.storage_dtype, self.block = storage
        h = attrs.get("hidden_size")
        if self.hidden_size is not None and h != self.hidden_size:
            self.errors.append(f"attr hidden_size: expected {self.hidden_size}, found {h!r}")

    def _check_layout(self) -> bool:
        f = self.f
        missing = [name for name in _required_datasets(self.attrs) if name not in f]
        if missing:
            self.errors.append(f"missing datasets {missing}")
            return False
        attrs = self.attrs
        h = attrs.get("hidden_size")
        n_before = len(self.errors)

        ids_ds = f["sample_ids"]
        tokens = f["input_ids"].shape[0] if f["input_ids"].ndim == 1 else -1
        samples = ids_ds.shape[0] if ids_ds.ndim == 1 else -1
        self.num_tokens, self.num_samples = max(tokens, 0), max(samples, 0)
        storage = _STORAGE_DTYPES[self.storage_dtype] if self.storage_dtype else None
        hidden = h if isinstance(h, int) and not isinstance(h, bool) and h > 0 else None

        expected: dict[str, tuple[np.dtype | None, tuple[int, ...] | None]] = {
            "input_ids": (np.dtype(np.int32), (tokens,)),
            "loss_mask": (np.dtype(np.uint8), (tokens,)),
            "sample_offsets": (np.dtype(np.int64), (samples + 1,)),
        }
        for name, layers in _HIDDEN:
            expected[name] = (storage, (tokens, layers * hidden) if hidden else None)
            if self.block is not None:
                blocks = _num_blocks(hidden, self.block) if hidden else None
                shape = (tokens, layers * blocks) if blocks else None
                expected[name + _SCALE_SUFFIX] = (_SCALE_DTYPE, shape)
        for name, (dtype, shape) in expected.items():
            ds = f[name]
            if dtype is not None and ds.dtype != dtype:
                self.errors.append(f"{name}: dtype {ds.dtype}, expected {dtype}")
            if shape is not None and ds.shape != shape:
                self.errors.append(f"{name}: shape {ds.shape}, expected {shape}")
        info = h5py.check_string_dtype(ids_ds.dtype)
        if info is None or info.encoding != "utf-8" or info.length is not None:
            self.errors.append(f"sample_ids: dtype {ids_ds.dtype}, expected variable-length UTF-8")
        if ids_ds.ndim != 1:
            self.errors.append(f"sample_ids: shape {ids_ds.shape}, expected (N,)")
        for attr, actual in (("num_samples", self.num_samples), ("num_tokens", self.num_tokens)):
            if attrs.get(attr) != actual:
                self.errors.append(f"attr {attr}={attrs.get(attr)!r} but datasets hold {actual}")
        return len(self.errors) == n_before

    def _check_offsets(self) -> None:
        offsets = self.f["sample_offsets"][()]
        before = len(self.errors)
        if offsets[0] != 0:
            self.errors.append(f"sample_offsets: starts at {offsets[0]}, expected 0")
        steps = np.diff(offsets)
        if (steps <= 0).any():
            i = int(np.flatnonzero(steps <= 0)[0])
            self.errors.append(
                f"sample_offsets: not strictly increasing at index {i} "
                f"({offsets[i]} -> {offsets[i + 1]}); every sample needs at least one token"
            )
        if offsets[-1] != self.num_tokens:
            self.errors.append(
                f"sample_offsets: ends at {offsets[-1]}, expected num_tokens {self.num_tokens}"
            )
        if len(self.errors) == before:
            self.offsets = offsets

    def _check_ids(self) -> None:
        ids = [str(s) for s in self.f["sample_ids"].asstr()[()]]
        self.ids = ids
        empty = [i for i, s in enumerate(ids) if not s]
        if empty:
            self.errors.append(f"sample_ids: empty id at index {empty[0]} ({len(empty)} in all)")
        seen: set[str] = set()
        dups: list[str] = []
        for s in ids:
            if s in seen and s not in dups:
                dups.append(s)
            seen.add(s)
        for s in dups[:_MAX_SAMPLE_ERRORS]:
            self.errors.append(f"sample_ids: duplicate id {s!r}")
        self._more(len(dups), "duplicate ids")
        if self.expected_ids is not None:
            expected = [str(s) for s in self.expected_ids]
            if ids != expected:
                self.errors.append(
                    f"sample_ids: do not match expected ids ({_first_difference(expected, ids)})"
                )

    def _check_tokens(self) -> None:
        input_ids = self.f["input_ids"][()]
        if input_ids.size and input_ids.min() < 0:
            self.errors.append(f"input_ids: negative token id {int(input_ids.min())}")
        mask = self.f["loss_mask"][()]
        if mask.size and mask.max() > 1:
            self.errors.append(f"loss_mask: values must be 0 or 1, found {int(mask.max())}")
        if self.offsets is None or self.ids is None or not self.num_samples:
            return
        per_sample = np.add.reduceat((mask != 0).astype(np.int64), self.offsets[:-1])
        no_loss = np.flatnonzero(per_sample == 0)
        for i in no_loss[:_MAX_SAMPLE_ERRORS]:
            self.errors.append(f"loss_mask: sample {self.ids[i]!r} has no loss tokens")
        self._more(len(no_loss), "samples without loss tokens")

    def _check_rows(self, name: str, bad_rows_of: Any) -> None:
        """Scan ``name`` in bounded reads; ``bad_rows_of(rows)`` flags the bad ones."""
        ds = self.f[name]
        total = ds.shape[0]
        row_bytes = max(1, ds.dtype.itemsize * int(np.prod(ds.shape[1:], dtype=np.int64)))
        step = max(1, _SCAN_BYTES // row_bytes)
        if ds.chunks:  # whole chunks per read, so no chunk is decompressed twice
            step = max(ds.chunks[0], step - step % ds.chunks[0])
        bad_rows: list[np.ndarray] = []
        for start in range(0, total, step):
            bad = bad_rows_of(ds[start : start + step])
            if bad.any():
                bad_rows.append(np.flatnonzero(bad) + start)
        if not bad_rows:
            return
        rows = np.concatenate(bad_rows)
        scales = name.endswith(_SCALE_SUFFIX)
        what = "non-finite or non-positive scales" if scales else "non-finite values"
        if self.offsets is None or self.ids is None:
            self.errors.append(f"{name}: {what} in {rows.size} rows (first row {rows[0]})")
            return
        samples = np.unique(np.searchsorted(self.offsets, rows, side="right") - 1)
        for i in samples[:_MAX_SAMPLE_ERRORS]:
            self.errors.append(f"{name}: sample {self.ids[i]!r} has {what}")
        self._more(len(samples), f"samples with {what} in {name}")

    def _more(self, count: int, what: str) -> None:
        if count > _MAX_SAMPLE_ERRORS:
            self.errors.append(f"... {count - _MAX_SAMPLE_ERRORS} more {what} not listed")


# --------------------------------------------------------------------------- helpers


def _check_hidden_dtype(hidden_dtype: Any) -> None:
    if not isinstance(hidden_dtype, str) or hidden_dtype not in _HIDDEN_DTYPES:
        raise ValueError(
            f"hidden_dtype must be one of {list(_HIDDEN_DTYPES)}, got {hidden_dtype!r}"
        )


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _header_errors(attrs: Mapping[str, Any]) -> list[str]:
    errors = []
    if attrs.get("format") != FORMAT_NAME:
        errors.append(f"attr format={attrs.get('format')!r}, expected {FORMAT_NAME!r}")
    version = attrs.get("format_version")
    if isinstance(version, bool) or version not in FORMAT_VERSIONS:
        errors.append(
            f"attr format_version={version!r}, "
            f"this reader understands {', '.join(map(str, FORMAT_VERSIONS))}"
        )
    dtype = attrs.get("hidden_dtype")
    if not isinstance(dtype, str) or dtype not in _HIDDEN_DTYPES:
        errors.append(f"attr hidden_dtype={dtype!r}, expected one of {list(_HIDDEN_DTYPES)}")
    else:
        errors.extend(_storage_errors(attrs, dtype))
    h = attrs.get("hidden_size")
    if isinstance(h, bool) or not isinstance(h, int) or h < 1:
        errors.append(f"attr hidden_size={h!r}, expected a positive integer")
    return errors


def _storage_errors(attrs: Mapping[str, Any], hidden_dtype: str) -> list[str]:
    """How the states are stored, given a valid ``hidden_dtype``."""
    storage = attrs.get("storage_dtype", hidden_dtype)  # absent before float8 existed
    if storage not in (hidden_dtype, FP8_DTYPE):
        return [f"attr storage_dtype={storage!r}, expected {hidden_dtype!r} or {FP8_DTYPE!r}"]
    errors = []
    if attrs.get("hidden_encoding") != _ENCODINGS[storage]:
        errors.append(
            f"attr hidden_encoding={attrs.get('hidden_encoding')!r}, "
            f"expected {_ENCODINGS[storage]!r} for {storage}"
        )
    if storage == FP8_DTYPE:
        if attrs.get("format_version") == _PLAIN_VERSION:
            errors.append(f"attr format_version=1, but {FP8_DTYPE} storage is version 2")
        if attrs.get("scale_granularity") != FP8_GRANULARITY:
            errors.append(
                f"attr scale_granularity={attrs.get('scale_granularity')!r}, "
                f"expected {FP8_GRANULARITY!r}"
            )
        if not _is_positive_int(attrs.get("scale_block_size")):
            errors.append(
                f"attr scale_block_size={attrs.get('scale_block_size')!r}, "
                f"expected a positive integer"
            )
    return errors


def _storage_of(attrs: Mapping[str, Any]) -> tuple[str, int | None] | None:
    """(storage dtype, float8 block size or None), or None if the header does not say."""
    dtype = attrs.get("hidden_dtype")
    if not isinstance(dtype, str) or dtype not in _HIDDEN_DTYPES or _storage_errors(attrs, dtype):
        return None
    storage = attrs.get("storage_dtype", dtype)
    return storage, int(attrs["scale_block_size"]) if storage == FP8_DTYPE else None


def _required_datasets(attrs: Mapping[str, Any]) -> tuple[str, ...]:
    if attrs.get("storage_dtype") != FP8_DTYPE:
        return _DATASETS
    return (*_DATASETS, *(name + _SCALE_SUFFIX for name, _ in _HIDDEN))


def _num_blocks(hidden_size: int, block: int) -> int:
    """Scales per token per layer: ``block``-channel blocks, the last one maybe shorter."""
    return -(-hidden_size // block)


def _torch_module() -> Any:
    # A tensor can only exist if torch is already imported; avoid importing it for numpy callers.
    return sys.modules.get("torch")


def _check_shape(x: Any, expected: tuple[int, ...], name: str, sample_id: str, width: str) -> None:
    shape = tuple(int(d) for d in (x.shape if hasattr(x, "shape") else np.shape(x)))
    if shape != expected:
        raise ShardFormatError(
            f"sample {sample_id!r}: {name} has shape {shape}, expected {expected} = [T, {width}]"
        )


def _plain_array(x: Any) -> np.ndarray:
    torch = _torch_module()
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _token_ids(x: Any, sample_id: str) -> np.ndarray:
    ids = _plain_array(x)
    if ids.ndim != 1 or ids.shape[0] == 0:
        raise ShardFormatError(
            f"sample {sample_id!r}: input_ids must have shape [T] with T > 0, got {ids.shape}"
        )
    if ids.dtype.kind not in "iu":
        raise ShardFormatError(f"sample {sample_id!r}: input_ids must be integers, got {ids.dtype}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi > _INT32_MAX:
        raise ShardFormatError(
            f"sample {sample_id!r}: input_ids must be in 0..{_INT32_MAX}, found {lo}..{hi}"
        )
    return ids.astype(np.int32, copy=False)


def _loss_mask(x: Any, sample_id: str, num_tokens: int) -> np.ndarray:
    mask = _plain_array(x)
    if mask.shape != (num_tokens,):
        raise ShardFormatError(
            f"sample {sample_id!r}: loss_mask has shape {mask.shape}, expected ({num_tokens},)"
        )
    if mask.dtype.kind not in "biu":
        raise ShardFormatError(
            f"sample {sample_id!r}: loss_mask must be bool or integer 0/1, got {mask.dtype}"
        )
    if mask.dtype.kind != "b" and (mask.min() < 0 or mask.max() > 1):
        raise ShardFormatError(f"sample {sample_id!r}: loss_mask must hold only 0 and 1")
    if not mask.any():
        raise ShardFormatError(f"sample {sample_id!r}: loss_mask has no loss tokens")
    return mask.astype(np.uint8, copy=False)


def _to_storage(x: Any, hidden_dtype: str, name: str, sample_id: str) -> np.ndarray:
    """Cast to ``hidden_dtype`` (round to nearest even) and return what goes on disk."""
    torch = _torch_module()
    if torch is not None and isinstance(x, torch.Tensor):
        if not x.is_floating_point():
            raise ShardFormatError(
                f"sample {sample_id!r}: {name} must be floating point, got {x.dtype}"
            )
        target = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
        # Cast before the device-to-host copy: fewer bytes cross the bus.
        t = x.detach().to(target[hidden_dtype]).cpu().contiguous()
        if hidden_dtype == "bfloat16":
            return t.view(torch.int16).numpy().view(np.uint16)
        return t.numpy()

    a = np.asarray(x)
    if a.dtype.name == "bfloat16" and a.dtype.itemsize == 2:  # ml_dtypes arrays: keep the bits
        if hidden_dtype == "bfloat16":
            return a.view(np.uint16)
        a = _bf16_bits_to_float32(a.view(np.uint16))
    if a.dtype.kind != "f":
        raise ShardFormatError(
            f"sample {sample_id!r}: {name} must be floating point, got {a.dtype}"
        )
    if hidden_dtype == "bfloat16":
        # float64 input is rounded via float32; hidden states never need that precision.
        return _float32_to_bf16_bits(a.astype(np.float32, copy=False))
    return a.astype(_STORAGE_DTYPES[hidden_dtype], copy=False)


def _float32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16 bits, matching ``tensor.to(torch.bfloat16)``."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    bits = ((u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        bits[nan] = 0x7FC0  # torch's canonical NaN; rounding could otherwise turn NaN into inf
    return bits


def _bf16_bits_to_float32(u16: np.ndarray) -> np.ndarray:
    return (u16.astype(np.uint32) << 16).view(np.float32)


def _nonfinite_rows(stored: np.ndarray, storage_dtype: str) -> np.ndarray:
    """Per-row flag: any NaN/inf in the stored representation."""
    if storage_dtype == "bfloat16":  # an all-ones exponent means inf or NaN
        bad = (stored & np.uint16(0x7F80)) == 0x7F80
    elif storage_dtype == FP8_DTYPE:  # e4m3fn has no inf; NaN is S.1111.111
        bad = (stored & np.uint8(0x7F)) == 0x7F
    else:
        bad = ~np.isfinite(stored)
    return bad.reshape(bad.shape[0], -1).any(axis=1)


def _bad_scale_rows(scales: np.ndarray) -> np.ndarray:
    """Per-row flag: a float8 scale that is not finite and positive."""
    return ~(np.isfinite(scales) & (scales > 0)).all(axis=1)


# --------------------------------------------------------------------------- float8


def _fp8_code_values() -> np.ndarray:
    """float32 value of each float8_e4m3fn bit pattern (NaN for 0x7F and 0xFF)."""
    code = np.arange(256, dtype=np.int64)
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    magnitude = np.where(
        exponent == 0,
        mantissa / 8.0 * 2.0**-6,  # subnormal
        (1 + mantissa / 8.0) * np.exp2(exponent - 7.0),
    )
    values = np.where(code & 0x80, -magnitude, magnitude).astype(np.float32)
    values[(code & 0x7F) == 0x7F] = np.nan
    return values


_FP8_VALUES = _fp8_code_values()


def _float32_to_fp8_bits(a: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> float8_e4m3fn bits, for |a| <= 448 or NaN,
    matching ``tensor.to(torch.float8_e4m3fn)``."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    sign = ((u >> 24) & np.uint32(0x80)).astype(np.uint8)
    mag = u & np.uint32(0x7FFFFFFF)
    # Normal range: keep 3 of float32's 23 mantissa bits, rounding to nearest even,
    # and rebias the exponent (127 -> 7). 448 is the largest value, so no rounding overflows.
    rounded = (mag + (np.uint32(0x7FFFF) + ((mag >> 20) & np.uint32(1)))) >> 20
    normal = rounded.astype(np.int64) - ((127 - 7) << 3)
    # Below 2**-6: subnormals, multiples of 2**-9 (np.rint rounds halves to even).
    absolute = mag.view(np.float32)
    nan = np.isnan(absolute)
    subnormal = np.rint(np.where(nan, 0, absolute) * np.float32(512.0)).astype(np.int64)
    code = np.where(absolute < np.float32(2.0**-6), subnormal, normal)
    code = np.where(nan, 0x7F, code).astype(np.uint8)
    return code | sign


def _to_fp8(
    x: Any, hidden_dtype: str, layers: int, h: int, block: int, name: str, sample_id: str
) -> tuple[np.ndarray, np.ndarray]:
    """States [T, layers * h], cast to ``hidden_dtype``, as float8 bits [T, layers * h]
    and float32 scales [T, layers * ceil(h / block)] (scale = block amax / 448)."""
    torch = _torch_module()
    if torch is not None and isinstance(x, torch.Tensor):
        if not x.is_floating_point():
            raise ShardFormatError(
                f"sample {sample_id!r}: {name} must be floating point, got {x.dtype}"
            )
        # Where the states are (a GPU, if the caller kept them there): a quarter of
        # float32's bytes cross the bus. In place on one float32 copy: this runs on the
        # writer thread for every batch.
        values = x.detach().to(getattr(torch, hidden_dtype)).to(torch.float32, copy=True)
        blocks, pad = _blocks_of(values, layers, h, block, torch.nn.functional.pad)
        # NaN/inf in a block give a NaN/inf scale: the caller's non-finite check.
        amax = torch.maximum(blocks.amax(dim=-1, keepdim=True), -blocks.amin(dim=-1, keepdim=True))
        scale = torch.where(amax == 0, torch.ones_like(amax), amax / FP8_MAX)
        q = blocks.div_(scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        bits = _unblock(q.view(torch.uint8), layers, h, pad).cpu().contiguous().numpy()
        return bits, scale.squeeze(-1).cpu().numpy()

    # numpy: the same float32 arithmetic, bit for bit.
    values = _decode_hidden(_to_storage(x, hidden_dtype, name, sample_id), hidden_dtype, False)
    values = np.array(values, dtype=np.float32)  # a copy: changed in place below

    def np_pad(a: np.ndarray, widths: tuple[int, int]) -> np.ndarray:
        return np.pad(a, [(0, 0)] * (a.ndim - 1) + [widths])

    blocks, pad = _blocks_of(values, layers, h, block, np_pad)
    amax = np.maximum(blocks.max(axis=-1, keepdims=True), -blocks.min(axis=-1, keepdims=True))
    with np.errstate(invalid="ignore"):
        scale = np.where(amax == 0, np.float32(1.0), amax / np.float32(FP8_MAX))
        np.divide(blocks, scale, out=blocks)
    np.clip(blocks, -FP8_MAX, FP8_MAX, out=blocks)
    return _unblock(_float32_to_fp8_bits(blocks), layers, h, pad), scale[..., 0]


def _blocks_of(values: Any, layers: int, h: int, block: int, pad_fn: Any) -> tuple[Any, int]:
    """[T, layers * h] -> [T, layers * nb, block], each layer zero-padded to nb * block."""
    t, nb = values.shape[0], _num_blocks(h, block)
    pad = nb * block - h
    per_layer = values.reshape(t, layers, h)
    if pad:
        per_layer = pad_fn(per_layer, (0, pad))
    return per_layer.reshape(t, layers * nb, block), pad


def _unblock(blocks: Any, layers: int, h: int, pad: int) -> Any:
    """Inverse of :func:`_blocks_of`."""
    t = blocks.shape[0]
    return blocks.reshape(t, layers, h + pad)[..., :h].reshape(t, layers * h)


def _dequantize_fp8(bits: np.ndarray, scales: np.ndarray, h: int, block: int) -> np.ndarray:
    """float8 bits [T, layers * h] times their block scales -> float32 [T, layers * h]."""
    values = _FP8_VALUES[bits]  # a lookup: faster than any float8 cast on CPUs
    t, width = values.shape
    layers, nb = width // h, _num_blocks(h, block)
    if h % block == 0:
        per_block = values.reshape(t, layers * nb, block)
        per_block *= scales.reshape(t, layers * nb, 1)
        return values
    for j in range(layers * nb):  # a shorter last block per layer: block by block, in place
        start = (j // nb) * h + (j % nb) * block
        values[:, start : min(start + block, (j // nb + 1) * h)] *= scales[:, j : j + 1]
    return values


def _round_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 rounded (nearest even) to the bfloat16 grid, in place; still float32."""
    u = values.view(np.uint32)
    u += np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))
    u &= np.uint32(0xFFFF0000)
    return values


def _decode_hidden(stored: np.ndarray, hidden_dtype: str, as_torch: bool) -> Any:
    if as_torch:
        import torch

        if hidden_dtype == "bfloat16":
            return torch.from_numpy(stored.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(stored)
    if hidden_dtype == "bfloat16":
        return _bf16_bits_to_float32(stored)
    return stored


def _encode_attrs(attrs: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    json_keys: list[str] = []
    for key, value in attrs.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"attr names must be non-empty strings, got {key!r}")
        if isinstance(value, Mapping):
            try:
                out[key] = json.dumps(value, sort_keys=True)
            except (TypeError, ValueError) as e:
                raise TypeError(f"attr {key!r}: dict value is not JSON-serialisable: {e}") from e
            json_keys.append(key)
        elif isinstance(value, os.PathLike):
            out[key] = os.fspath(value)
        elif isinstance(value, (str, bool, int, float, np.generic)):
            out[key] = value
        elif isinstance(value, (list, tuple, np.ndarray)):
            out[key] = _attr_array(key, value)
        else:
            raise TypeError(
                f"attr {key!r}: cannot store {type(value).__name__} in HDF5 "
                f"(use str, number, bool, list or dict)"
            )
    if json_keys:
        out[_JSON_ATTRS] = np.asarray(json_keys, dtype=h5py.string_dtype("utf-8"))
    return out


def _attr_array(key: str, value: Any) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype.kind in "UO":
        # numpy would quietly turn [1, "a"] into ["1", "a"]; only all-string lists are strings.
        items = np.asarray(value, dtype=object).ravel()
        if items.size and all(isinstance(v, str) for v in items):
            return np.asarray(value, dtype=h5py.string_dtype("utf-8"))
    elif arr.dtype.kind in "biuf":
        return arr
    raise TypeError(f"attr {key!r}: list must hold only numbers or only strings, got {value!r}")


def _decode_attrs(raw: h5py.AttributeManager) -> dict[str, Any]:
    attrs = {key: _decode_value(raw[key]) for key in raw}
    json_keys = attrs.pop(_JSON_ATTRS, [])
    for key in json_keys if isinstance(json_keys, list) else []:
        if isinstance(attrs.get(key), str):
            attrs[key] = json.loads(attrs[key])
    return attrs


def _decode_value(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "OS":
            return [_decode_value(v) for v in value.tolist()]
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _first_difference(expected: list[str], found: list[str]) -> str:
    for i, (a, b) in enumerate(zip(expected, found, strict=False)):
        if a != b:
            return f"first difference at index {i}: expected {a!r}, found {b!r}"
    return f"expected {len(expected)} ids, found {len(found)}"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
