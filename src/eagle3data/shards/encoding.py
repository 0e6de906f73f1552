"""How states and tokens become what a shard stores, and back: the checks and casts of token
ids and loss masks, bfloat16 as uint16 bits, scaled float8 (e4m3fn) in blocks, and the
non-finite checks on the stored bits (:mod:`eagle3data.shards` describes the encodings)."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ..errors import ShardFormatError
from .format import FP8_DTYPE, FP8_MAX, STORAGE_DTYPES, num_blocks

_INT32_MAX = np.iinfo(np.int32).max


def _torch_module() -> Any:
    # A tensor can only exist if torch is already imported; avoid importing it for numpy callers.
    return sys.modules.get("torch")


def check_shape(x: Any, expected: tuple[int, ...], name: str, sample_id: str, width: str) -> None:
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


def checked_token_ids(x: Any, sample_id: str) -> np.ndarray:
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


def checked_loss_mask(x: Any, sample_id: str, num_tokens: int) -> np.ndarray:
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


def to_storage(x: Any, hidden_dtype: str, name: str, sample_id: str) -> np.ndarray:
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
        a = bf16_bits_to_float32(a.view(np.uint16))
    if a.dtype.kind != "f":
        raise ShardFormatError(
            f"sample {sample_id!r}: {name} must be floating point, got {a.dtype}"
        )
    if hidden_dtype == "bfloat16":
        # float64 input is rounded via float32; hidden states never need that precision.
        return float32_to_bf16_bits(a.astype(np.float32, copy=False))
    return a.astype(STORAGE_DTYPES[hidden_dtype], copy=False)


def float32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16 bits, matching ``tensor.to(torch.bfloat16)``."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    bits = ((u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        bits[nan] = 0x7FC0  # torch's canonical NaN; rounding could otherwise turn NaN into inf
    return bits


def bf16_bits_to_float32(u16: np.ndarray) -> np.ndarray:
    return (u16.astype(np.uint32) << 16).view(np.float32)


def nonfinite_rows(stored: np.ndarray, storage_dtype: str) -> np.ndarray:
    """Per-row flag: any NaN/inf in the stored representation."""
    if storage_dtype == "bfloat16":  # an all-ones exponent means inf or NaN
        bad = (stored & np.uint16(0x7F80)) == 0x7F80
    elif storage_dtype == FP8_DTYPE:  # e4m3fn has no inf; NaN is S.1111.111
        bad = (stored & np.uint8(0x7F)) == 0x7F
    else:
        bad = ~np.isfinite(stored)
    return bad.reshape(bad.shape[0], -1).any(axis=1)


def bad_scale_rows(scales: np.ndarray) -> np.ndarray:
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


FP8_VALUES = _fp8_code_values()


def float32_to_fp8_bits(a: np.ndarray) -> np.ndarray:
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


def to_fp8(
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
    values = decode_hidden(to_storage(x, hidden_dtype, name, sample_id), hidden_dtype, False)
    values = np.array(values, dtype=np.float32)  # a copy: changed in place below

    def np_pad(a: np.ndarray, widths: tuple[int, int]) -> np.ndarray:
        return np.pad(a, [(0, 0)] * (a.ndim - 1) + [widths])

    blocks, pad = _blocks_of(values, layers, h, block, np_pad)
    amax = np.maximum(blocks.max(axis=-1, keepdims=True), -blocks.min(axis=-1, keepdims=True))
    with np.errstate(invalid="ignore"):
        scale = np.where(amax == 0, np.float32(1.0), amax / np.float32(FP8_MAX))
        np.divide(blocks, scale, out=blocks)
    np.clip(blocks, -FP8_MAX, FP8_MAX, out=blocks)
    return _unblock(float32_to_fp8_bits(blocks), layers, h, pad), scale[..., 0]


def _blocks_of(values: Any, layers: int, h: int, block: int, pad_fn: Any) -> tuple[Any, int]:
    """[T, layers * h] -> [T, layers * nb, block], each layer zero-padded to nb * block."""
    t, nb = values.shape[0], num_blocks(h, block)
    pad = nb * block - h
    per_layer = values.reshape(t, layers, h)
    if pad:
        per_layer = pad_fn(per_layer, (0, pad))
    return per_layer.reshape(t, layers * nb, block), pad


def _unblock(blocks: Any, layers: int, h: int, pad: int) -> Any:
    """Inverse of :func:`_blocks_of`."""
    t = blocks.shape[0]
    return blocks.reshape(t, layers, h + pad)[..., :h].reshape(t, layers * h)


def dequantize_fp8(bits: np.ndarray, scales: np.ndarray, h: int, block: int) -> np.ndarray:
    """float8 bits [T, layers * h] times their block scales -> float32 [T, layers * h]."""
    values = FP8_VALUES[bits]  # a lookup: faster than any float8 cast on CPUs
    t, width = values.shape
    layers, nb = width // h, num_blocks(h, block)
    if h % block == 0:
        per_block = values.reshape(t, layers * nb, block)
        per_block *= scales.reshape(t, layers * nb, 1)
        return values
    for j in range(layers * nb):  # a shorter last block per layer: block by block, in place
        start = (j // nb) * h + (j % nb) * block
        values[:, start : min(start + block, (j // nb + 1) * h)] *= scales[:, j : j + 1]
    return values


def round_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 rounded (nearest even) to the bfloat16 grid, in place; still float32."""
    u = values.view(np.uint32)
    u += np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))
    u &= np.uint32(0xFFFF0000)
    return values


def decode_hidden(stored: np.ndarray, hidden_dtype: str, as_torch: bool) -> Any:
    if as_torch:
        import torch

        if hidden_dtype == "bfloat16":
            return torch.from_numpy(stored.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(stored)
    if hidden_dtype == "bfloat16":
        return bf16_bits_to_float32(stored)
    return stored
