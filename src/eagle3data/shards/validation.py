"""Checking a shard completely (:func:`validate_shard`): header, layout, offsets, ids,
tokens and every stored state, in bounded reads; problems come back as errors, never
raised."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from .encoding import bad_scale_rows, nonfinite_rows
from .format import (
    FP8_DTYPE,
    HIDDEN,
    SCALE_DTYPE,
    SCALE_SUFFIX,
    STORAGE_DTYPES,
    decode_attrs,
    header_errors,
    num_blocks,
    required_datasets,
    storage_of,
)

# Rows per read when scanning hidden states, to keep validation memory bounded.
_SCAN_BYTES = 64 << 20
# Cap per-sample messages so one broken shard doesn't produce a million-line report.
_MAX_SAMPLE_ERRORS = 20


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
            for name, _ in HIDDEN:
                self._check_rows(name, partial(nonfinite_rows, storage_dtype=self.storage_dtype))
                if self.storage_dtype == FP8_DTYPE:
                    self._check_rows(name + SCALE_SUFFIX, bad_scale_rows)

    def _check_header(self) -> None:
        attrs = self.attrs = decode_attrs(self.f.attrs)
        self.errors.extend(header_errors(attrs))
        storage = storage_of(attrs)
        if storage is not None:
            self.storage_dtype, self.block = storage
        h = attrs.get("hidden_size")
        if self.hidden_size is not None and h != self.hidden_size:
            self.errors.append(f"attr hidden_size: expected {self.hidden_size}, found {h!r}")

    def _check_layout(self) -> bool:
        f = self.f
        missing = [name for name in required_datasets(self.attrs) if name not in f]
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
        storage = STORAGE_DTYPES[self.storage_dtype] if self.storage_dtype else None
        hidden = h if isinstance(h, int) and not isinstance(h, bool) and h > 0 else None

        expected: dict[str, tuple[np.dtype | None, tuple[int, ...] | None]] = {
            "input_ids": (np.dtype(np.int32), (tokens,)),
            "loss_mask": (np.dtype(np.uint8), (tokens,)),
            "sample_offsets": (np.dtype(np.int64), (samples + 1,)),
        }
        for name, layers in HIDDEN:
            expected[name] = (storage, (tokens, layers * hidden) if hidden else None)
            if self.block is not None:
                blocks = num_blocks(hidden, self.block) if hidden else None
                shape = (tokens, layers * blocks) if blocks else None
                expected[name + SCALE_SUFFIX] = (SCALE_DTYPE, shape)
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
        scales = name.endswith(SCALE_SUFFIX)
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


def _first_difference(expected: list[str], found: list[str]) -> str:
    for i, (a, b) in enumerate(zip(expected, found, strict=False)):
        if a != b:
            return f"first difference at index {i}: expected {a!r}, found {b!r}"
    return f"expected {len(expected)} ids, found {len(found)}"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
