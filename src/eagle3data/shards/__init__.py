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

from ..errors import ShardFormatError
from .format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    FORMAT_VERSIONS,
    FP8_BLOCK_SIZE,
    FP8_DTYPE,
    HiddenDtype,
    StorageDtype,
    bytes_per_token,
)
from .reader import Shard, open_shard
from .validation import ShardCheck, file_sha256, validate_shard
from .writer import ShardWriter

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
