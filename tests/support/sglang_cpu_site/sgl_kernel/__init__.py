"""A stand-in for ``sgl_kernel`` that lets SGLang 0.5.23 run on a CPU without AMX, in tests.

Why it exists: with ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports a few helper ops from
``sgl_kernel`` at module import, whatever the CPU (``assign_req_to_token_pool_cpu`` in
``mem_cache/allocation.py``, ``copy_all_layer_kv_cache_cpu`` in
``kernels/ops/kvcache/cache_move.py``, ...). The registry's ``sglang-kernel`` wheel is
CUDA-only (``import sgl_kernel`` fails without ``libcuda.so.1``) and SGLang's CPU kernel library
is built only from its source tree. On a CPU without AMX (``cpu_has_amx_support()`` false)
SGLang computes with its plain torch ``forward_native`` paths and its ``torch_native``
attention, and of ``sgl_kernel`` it calls only the scheduling helper below.

What it replaces:

* :func:`assign_req_to_token_pool_cpu`: implemented in torch with the semantics of SGLang's
  Triton kernel ``assign_req_to_token_pool`` (``mem_cache/allocation.py``): request ``i``'s
  slots ``[start_i, end_i)`` of its ``req_to_token`` row take the next ``end_i - start_i``
  entries of ``out_cache_loc``, requests packed one after another. Decoding needs it.
* the names in :data:`NOT_IMPLEMENTED`: importable (SGLang imports them at module level on
  the CPU path), and each raises :class:`NotImplementedError` naming itself when called, so
  a code path that would need a real kernel stops loudly instead of computing something
  else;
* nothing else: any other name or submodule is absent, as if this sgl_kernel lacked it, so
  SGLang's own fallbacks for a missing kernel apply. ``torch.ops.sgl_kernel`` stays empty:
  SGLang calls those ops only on AMX CPUs.

It is put first on ``PYTHONPATH`` by ``tests/support/sglang_cpu.py`` and nowhere else:
production never sees it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__version__ = "0.0.0+eagle3data-cpu-stand-in"

# Imported by SGLang's modules on the CPU path (found by importing the engine and the HTTP
# server with SGLANG_USE_CPU_ENGINE=1); none is called on a CPU without AMX.
NOT_IMPLEMENTED = frozenset(
    {
        "assign_draft_cache_locs_contiguous_cpu",
        "assign_extend_cache_locs_cpu",
        "build_tree_kernel_efficient_cpu",
        "copy_all_layer_kv_cache_cpu",
        "fill_accept_out_cache_loc_cpu",
        "fill_bonus_tokens_cpu",
        "verify_tree_greedy_cpu",
    }
)


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``req_to_token[req_pool_indices[i], start_i:end_i] = out_cache_loc[packed slice i]``."""
    del pool_len  # the row length of req_to_token; torch indexing knows it
    offset = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        count = end - start
        req_to_token[row, start:end] = out_cache_loc[offset : offset + count].to(req_to_token.dtype)
        offset += count


def _not_implemented(qualname: str) -> Callable[..., Any]:
    def missing(*_args: Any, **_kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{qualname} is not implemented by the test suite's sgl_kernel stand-in "
            f"(tests/support/sglang_cpu_site): this SGLang code path needs the real "
            f"CPU kernel library"
        )

    missing.__name__ = missing.__qualname__ = qualname.rsplit(".", 1)[-1]
    return missing


def __getattr__(name: str) -> Any:
    if name in NOT_IMPLEMENTED:
        return _not_implemented(f"{__name__}.{name}")
    # Anything else is absent, as in an sgl_kernel without it: SGLang's own fallbacks apply
    # (e.g. its mock scalar types when sgl_kernel.scalar_type cannot be imported).
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
