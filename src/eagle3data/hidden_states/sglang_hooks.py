"""The rows SGLang returns: the forward hooks that make them, and the reading of them.

The hooks run in every SGLang worker (``forward_hooks``, resolved by the ``module:attr``
paths below): they join the aux states and the final state of each full-capture forward
into ``[aux | last]`` rows, handed back as lists or through shared memory
(:mod:`.handoff`). :func:`split_states`, in the job, checks one result's rows and splits
them into ``(aux [T, 3H], last [T, H])``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import SGLangCaptureError
from . import handoff
from .final_state import PRE_NORM

HOOK_FACTORY = "eagle3data.hidden_states.sglang_hooks:append_last_hidden_states_hook"
SHARED_HOOK_FACTORY = "eagle3data.hidden_states.sglang_hooks:shared_rows_hook"
PRE_NORM_HOOK_FACTORY = "eagle3data.hidden_states.sglang_hooks:pre_norm_hook"
# The text decoder's final norm: model.norm (Llama, DeepSeek-V3), language_model.model.norm
# (Kimi-K2.5's wrapper).
FINAL_NORM_MODULES = ["model.norm", "*.model.norm"]


def append_last_hidden_states_hook(config: Mapping[str, Any]) -> Callable[..., None]:
    """Forward-hook factory SGLang calls in each worker (``forward_hooks``).

    Under full capture with aux states, ``output.hidden_states`` holds the aux rows
    and ``output.last_hidden_states`` the post-norm rows of the same tokens; the
    hook puts both into the returned rows as ``[aux | last]`` (``last`` the pre-norm
    rows when ``config["final_state"]`` says so).
    """
    final_state = config["final_state"]  # engine_args always says (no default here)

    def hook(_module: Any, _inputs: Any, output: Any) -> None:
        parts = _captured_parts(output, final_state)
        if parts is not None:
            output.hidden_states = torch.cat(parts, dim=-1)
            output.last_hidden_states = None

    return hook


def shared_rows_hook(config: Mapping[str, Any]) -> Callable[..., None]:
    """Forward-hook factory of the shared-memory hand-off (:mod:`.handoff`): the joined
    ``[aux | last]`` rows go to a file in ``config["directory"]`` and SGLang returns
    their ``[T, 3]`` pointers instead."""
    writer = handoff.RowsWriter(config["directory"])
    final_state = config["final_state"]

    def hook(_module: Any, _inputs: Any, output: Any) -> None:
        parts = _captured_parts(output, final_state)
        if parts is not None:
            output.hidden_states = writer.put(parts)
            output.last_hidden_states = None

    return hook


# This worker's final-norm input of the forward running now (pre_norm_hook), taken by the
# logits processor's hook of the same forward.
_pre_norm_rows: list[torch.Tensor] = []


def pre_norm_hook(_config: Mapping[str, Any]) -> Callable[..., None]:
    """Forward-hook factory for the decoder's final norm: keeps its input, the pre-norm
    state. SGLang's norm takes ``(x, residual)`` and returns ``(normed, x + residual)``
    (its fused kernel may overwrite ``x`` in place): the updated residual is the input
    it normalized; without a residual the input is ``x``."""

    def hook(_module: Any, inputs: Any, output: Any) -> None:
        if isinstance(output, tuple) and len(output) == 2 and output[1] is not None:
            pre = output[1]
        else:
            pre = inputs[0]
        # A copy: the residual's storage is the layer stack's, reused by the next forward.
        _pre_norm_rows[:] = [pre.detach().clone()]

    return hook


def _captured_parts(output: Any, final_state: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(aux, last) of a full-capture forward, in the aux dtype; None for any other
    forward (decode, warm-up, a batch that asked for no states) or when a hook already ran."""
    aux = getattr(output, "hidden_states", None)
    last = getattr(output, "last_hidden_states", None)
    if aux is None or last is None or aux.shape[0] != last.shape[0]:
        return None
    if final_state == PRE_NORM and last.shape[0] == 0:
        # An idle forward (a data-parallel attention group with no request this step):
        # SGLang skips the final norm, and there is no row to replace.
        _pre_norm_rows.clear()
    elif final_state == PRE_NORM:
        pre = _pre_norm_rows.pop() if _pre_norm_rows else None
        if pre is None or pre.shape != last.shape:
            # Raised in the worker: the engine stops and the job names this rank.
            raise SGLangCaptureError(
                f"the final norm's input of this forward was "
                f"{'not seen' if pre is None else f'{list(pre.shape)}'} where the post-norm "
                f"state is {list(last.shape)}: the hook on {FINAL_NORM_MODULES} did not run "
                f"once per forward (hidden_states.final_state: post_norm captures without it)"
            )
        last = pre
    return aux, last.to(aux.dtype)


def split_states(
    output: Mapping[str, Any],
    length: int,
    hidden_size: int,
    dtype: torch.dtype,
    reader: handoff.RowsReader | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [T, 3H], last [T, H]) from one ``Engine.generate`` result, checked: the rows
    themselves (``lists``) or, with ``reader``, views of the rows they point at."""
    block = _prefill_block(output, length)
    if reader is not None:
        rows = reader.rows(block, length)
    else:
        rows = torch.tensor(block, dtype=torch.float32)
        width = rows.shape[1]
        if width != 4 * hidden_size:
            raise SGLangCaptureError(
                f"SGLang returned {width} values per token, expected 3 aux layers + the "
                f"final-norm state = {4 * hidden_size} (hidden_size {hidden_size}); is the "
                f"forward hook {HOOK_FACTORY} registered and does the model capture 3 "
                f"layers?"
            )
        # float32 -> model dtype is exact: the values were the model dtype's own.
        rows = rows.to(dtype)
    return rows[:, : 3 * hidden_size], rows[:, 3 * hidden_size :]


def _prefill_block(output: Mapping[str, Any], length: int) -> list[list[float]]:
    """The prompt's rows of one result, checked to be one per token."""
    meta = output.get("meta_info", {})
    blocks = meta.get("hidden_states")
    if not blocks:
        raise SGLangCaptureError(
            "SGLang returned no hidden states; the engine must run with "
            "enable_return_aux_hidden_states and the request with return_hidden_states"
        )
    prompt_tokens = meta.get("prompt_tokens", length)
    cached = meta.get("cached_tokens", 0) or 0
    block = blocks[0]
    square = bool(block) and all(isinstance(r, list) for r in block)
    if not square or len(block) != length or prompt_tokens != length or cached:
        raise SGLangCaptureError(
            f"SGLang returned {len(block) if square else 0} hidden-state rows for "
            f"a {length}-token sample (prompt_tokens={prompt_tokens}, cached_tokens="
            f"{cached}); expected one row per token. A radix-cache hit or chunked "
            f"prefill computes only part of the prompt: run with disable_radix_cache "
            f"and chunked_prefill_size=-1"
        )
    return block
