"""Reading a shard: :func:`open_shard` checks its header and layout and returns a
:class:`Shard`, whose token arrays are loaded and whose states are read on demand."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import h5py
import numpy as np

from ..errors import ShardFormatError
from .encoding import decode_hidden, dequantize_fp8, round_to_bf16
from .format import (
    FP8_DTYPE,
    SCALE_SUFFIX,
    STORAGE_DTYPES,
    HiddenDtype,
    StorageDtype,
    decode_attrs,
    header_errors,
    required_datasets,
)

if TYPE_CHECKING:
    import torch


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
            return decode_hidden(stored, self.hidden_dtype, as_torch)
        scale = self._file[name + SCALE_SUFFIX][rows]
        h, block = self.hidden_size, int(self.attrs["scale_block_size"])
        values = dequantize_fp8(stored, scale, h, block)
        if as_torch:
            import torch

            return torch.from_numpy(values).to(getattr(torch, self.hidden_dtype))
        if self.hidden_dtype == "bfloat16":
            return round_to_bf16(values)
        return values.astype(STORAGE_DTYPES[self.hidden_dtype], copy=False)


def open_shard(path: str | Path) -> Shard:
    """Open a shard for reading; raises :class:`ShardFormatError` if it is not a shard of
    a version this module reads (:data:`FORMAT_VERSIONS`).

    This checks the header and layout only; use :func:`validate_shard` for a full check.
    """
    path = Path(path)
    f = h5py.File(path, "r")
    try:
        attrs = decode_attrs(f.attrs)
        problems = header_errors(attrs)
        missing = [name for name in required_datasets(attrs) if name not in f]
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
