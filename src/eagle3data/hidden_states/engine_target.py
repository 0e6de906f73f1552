"""The target as an engine backend (sglang, vllm) reads it before it starts, apart from the
backends' registry (:mod:`.backends`), which builds the backends that read it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import model_config
from ..errors import UserError
from .final_state import FINAL_STATES
from .layers import AuxLayers, resolve_aux_layers


@dataclass(frozen=True)
class EngineTarget:
    """What an engine backend (sglang, vllm) reads of the target before it starts: its
    ``config.json``, the aux layers, its width and the dtype it computes in."""

    config: Mapping[str, Any]
    aux: AuxLayers
    hidden_size: int
    dtype_name: str


def read_engine_target(
    model_path: str,
    *,
    aux_layers: str | Sequence[int],
    convention: str,
    dtype: str,
    final_state: str,
    error: type[UserError],
) -> EngineTarget:
    """The target as an engine backend sees it; ``error`` for a ``final_state`` that is
    none of :data:`~.final_state.FINAL_STATES`."""
    if final_state not in FINAL_STATES:
        raise error(
            f"hidden_states.final_state must be one of {list(FINAL_STATES)}, got {final_state!r}"
        )
    config = model_config.read_model_config(model_path)
    return EngineTarget(
        config=config,
        aux=resolve_aux_layers(aux_layers, model_config.num_hidden_layers(config), convention),
        hidden_size=model_config.hidden_size(config),
        dtype_name=model_config.resolve_dtype_name(dtype, config),
    )
