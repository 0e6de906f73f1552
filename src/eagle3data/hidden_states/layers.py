"""Which decoder layers feed the EAGLE-3 draft model, named without ambiguity.

Two conventions name the same three tensors, and mixing them up silently shifts
every captured feature by one layer:

* ``"layer_output"`` (SpecForge, ModelOpt): id ``k`` is the output of 0-based
  decoder layer ``k``. The EAGLE-3 default is ``[1, L//2 - 1, L - 4]``.
* ``"hidden_states_index"`` (SGLang, vLLM, the official EAGLE code): id ``k`` is
  ``output_hidden_states[k]`` in transformers, where index 0 is the embeddings,
  i.e. the residual stream *entering* layer ``k``. The same default reads
  ``[2, L//2, L - 3]``.

``hidden_states_index = layer_output + 1``. Example for a 61-layer model:
layer_output ``[1, 29, 57]`` == hidden_states_index ``[2, 30, 58]``.

Everything in this package stores ``layer_output`` ids and records both forms in
shard attributes, so a reader never has to guess.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Literal, get_args

from ..checks import positive_int
from ..errors import AuxLayerError

Convention = Literal["layer_output", "hidden_states_index"]

NUM_AUX_LAYERS = 3

LAYER_OUTPUT_CONVENTION = "layer_output: output of 0-based decoder layer k"
HIDDEN_STATES_INDEX_CONVENTION = (
    "hidden_states_index: transformers output_hidden_states[k], 0 = embeddings"
)


@dataclass(frozen=True)
class AuxLayers:
    """Three auxiliary layers of a ``num_layers``-layer decoder, in the layer_output convention."""

    layer_ids: tuple[int, ...]
    num_layers: int

    def __post_init__(self) -> None:
        # Validate here too, so a hand-built AuxLayers cannot bypass resolve_aux_layers().
        _check_ids(self.layer_ids, self.num_layers, "layer_output")

    @property
    def hidden_states_indices(self) -> tuple[int, ...]:
        """The same layers as ``output_hidden_states`` indices (index 0 = embeddings)."""
        return tuple(k + 1 for k in self.layer_ids)

    def as_attrs(self) -> dict[str, Any]:
        """Both conventions, spelled out, for HDF5 attributes or JSON metadata."""
        return {
            "aux_layer_ids": list(self.layer_ids),
            "aux_layer_convention": LAYER_OUTPUT_CONVENTION,
            "aux_hidden_states_indices": list(self.hidden_states_indices),
            "aux_hidden_states_convention": HIDDEN_STATES_INDEX_CONVENTION,
            "num_layers": self.num_layers,
        }


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """The EAGLE-3 default ``(1, L//2 - 1, L - 4)`` in the layer_output convention."""
    num_layers = _check_num_layers(num_layers)
    ids = (1, num_layers // 2 - 1, num_layers - 4)
    if not ids[0] < ids[1] < ids[2]:
        # Below 7 layers the rule collapses or goes negative (L=6 gives [1, 2, 2]).
        raise AuxLayerError(
            f"the EAGLE-3 default rule [1, L//2-1, L-4] gives {list(ids)} for "
            f"num_layers={num_layers}, which is not strictly increasing (it needs at "
            f"least 7 decoder layers); pass explicit aux layer ids"
        )
    return ids


def resolve_aux_layers(
    spec: Literal["auto"] | Sequence[int],
    num_layers: int,
    convention: Convention = "layer_output",
) -> AuxLayers:
    """Turn a config value (``"auto"`` or three ids in ``convention``) into :class:`AuxLayers`."""
    num_layers = _check_num_layers(num_layers)
    if convention not in get_args(Convention):
        raise AuxLayerError(
            f"unknown aux layer convention {convention!r}; "
            f"expected one of {list(get_args(Convention))}"
        )
    if isinstance(spec, str):
        if spec != "auto":
            raise AuxLayerError(f"aux layers must be 'auto' or a list of 3 layer ids, got {spec!r}")
        return AuxLayers(default_aux_layer_ids(num_layers), num_layers)

    ids = _as_int_tuple(spec)
    _check_ids(ids, num_layers, convention)
    if convention == "hidden_states_index":
        ids = tuple(k - 1 for k in ids)
    return AuxLayers(ids, num_layers)


def _check_num_layers(num_layers: Any) -> int:
    return positive_int(num_layers, "num_layers", AuxLayerError)


def _as_int_tuple(spec: Sequence[int]) -> tuple[int, ...]:
    ids = []
    for item in spec:
        # bool is an int subclass; True as a layer id is always a config mistake.
        if isinstance(item, bool):
            raise AuxLayerError(f"aux layer id {item!r} is not an integer")
        try:
            ids.append(operator.index(item))
        except TypeError:
            raise AuxLayerError(f"aux layer id {item!r} is not an integer") from None
    return tuple(ids)


def _check_ids(ids: tuple[int, ...], num_layers: int, convention: Convention) -> None:
    if len(ids) != NUM_AUX_LAYERS:
        raise AuxLayerError(
            f"expected exactly {NUM_AUX_LAYERS} aux layer ids, got {len(ids)}: {list(ids)}"
        )
    if convention == "layer_output":
        low, high = 0, num_layers - 1
    else:
        low, high = 1, num_layers
    for k in ids:
        if convention == "hidden_states_index" and k == 0:
            raise AuxLayerError(
                "aux hidden_states_index 0 is the embedding output, not a decoder layer; "
                f"valid range is {low}..{high} for num_layers={num_layers}"
            )
        if not low <= k <= high:
            raise AuxLayerError(
                f"aux layer id {k} is out of range for {convention} with "
                f"num_layers={num_layers}; valid range is {low}..{high}"
            )
    if not all(a < b for a, b in pairwise(ids)):
        raise AuxLayerError(f"aux layer ids must be strictly increasing, got {list(ids)}")
