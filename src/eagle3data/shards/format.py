"""The shard format's constants, header and attributes (:mod:`eagle3data.shards` describes
the format): what a header must say, the datasets a shard holds, and how attributes are
encoded in HDF5."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Literal

import h5py
import numpy as np

from ..checks import positive_int

FORMAT_NAME = "eagle3-hidden-states"
#: The newest version this module reads and writes; it reads every one of FORMAT_VERSIONS.
FORMAT_VERSION = 2
FORMAT_VERSIONS = (1, 2)
# Written unless the shard needs version 2 (scaled float8 storage).
PLAIN_VERSION = 1
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
SCALE_DTYPE = np.dtype(np.float32)
SCALE_SUFFIX = "_scale"
HIDDEN_DTYPES = ("bfloat16", "float16", "float32")
STORAGE_DTYPES: dict[str, np.dtype] = {
    "bfloat16": np.dtype(np.uint16),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    FP8_DTYPE: np.dtype(np.uint8),
}
ENCODINGS = {
    "bfloat16": BF16_ENCODING,
    "float16": NATIVE_ENCODING,
    "float32": NATIVE_ENCODING,
    FP8_DTYPE: FP8_ENCODING,
}
_JSON_ATTRS = "json_attrs"
RESERVED_ATTRS = frozenset(
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
HIDDEN = (("aux_hidden_states", 3), ("last_hidden_states", 1))
_DATASETS = (
    "input_ids",
    "loss_mask",
    "aux_hidden_states",
    "last_hidden_states",
    "sample_offsets",
    "sample_ids",
)


def check_hidden_dtype(hidden_dtype: Any) -> None:
    if not isinstance(hidden_dtype, str) or hidden_dtype not in HIDDEN_DTYPES:
        raise ValueError(f"hidden_dtype must be one of {list(HIDDEN_DTYPES)}, got {hidden_dtype!r}")


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def header_errors(attrs: Mapping[str, Any]) -> list[str]:
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
    if not isinstance(dtype, str) or dtype not in HIDDEN_DTYPES:
        errors.append(f"attr hidden_dtype={dtype!r}, expected one of {list(HIDDEN_DTYPES)}")
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
    if attrs.get("hidden_encoding") != ENCODINGS[storage]:
        errors.append(
            f"attr hidden_encoding={attrs.get('hidden_encoding')!r}, "
            f"expected {ENCODINGS[storage]!r} for {storage}"
        )
    if storage == FP8_DTYPE:
        if attrs.get("format_version") == PLAIN_VERSION:
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


def storage_of(attrs: Mapping[str, Any]) -> tuple[str, int | None] | None:
    """(storage dtype, float8 block size or None), or None if the header does not say."""
    dtype = attrs.get("hidden_dtype")
    if not isinstance(dtype, str) or dtype not in HIDDEN_DTYPES or _storage_errors(attrs, dtype):
        return None
    storage = attrs.get("storage_dtype", dtype)
    return storage, int(attrs["scale_block_size"]) if storage == FP8_DTYPE else None


def required_datasets(attrs: Mapping[str, Any]) -> tuple[str, ...]:
    if attrs.get("storage_dtype") != FP8_DTYPE:
        return _DATASETS
    return (*_DATASETS, *(name + SCALE_SUFFIX for name, _ in HIDDEN))


def num_blocks(hidden_size: int, block: int) -> int:
    """Scales per token per layer: ``block``-channel blocks, the last one maybe shorter."""
    return -(-hidden_size // block)


def bytes_per_token(hidden_size: int, hidden_dtype: str, storage_dtype: str | None = None) -> int:
    """Stored bytes per token, uncompressed: (3H + H) hidden values (+ their float8
    scales) + int32 id + uint8 mask. ``storage_dtype`` defaults to ``hidden_dtype``."""
    check_hidden_dtype(hidden_dtype)
    hidden_size = positive_int(hidden_size, "hidden_size")
    storage = hidden_dtype if storage_dtype in (None, "auto") else storage_dtype
    if storage not in (hidden_dtype, FP8_DTYPE):
        raise ValueError(
            f"storage_dtype must be {hidden_dtype!r} or {FP8_DTYPE!r}, got {storage!r}"
        )
    scales = 0
    if storage == FP8_DTYPE:
        scales = 4 * num_blocks(hidden_size, FP8_BLOCK_SIZE) * SCALE_DTYPE.itemsize
    return 4 * hidden_size * STORAGE_DTYPES[storage].itemsize + scales + 4 + 1


def encode_attrs(attrs: Mapping[str, Any]) -> dict[str, Any]:
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


def decode_attrs(raw: h5py.AttributeManager) -> dict[str, Any]:
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
