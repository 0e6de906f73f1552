"""What made a shard's states, stored in every shard and manifest: the capture fingerprint.

Drafts trained on data captured the wrong way train fine and then accept nothing, and
nothing in the states says why. So every shard records, in its ``capture_fingerprint``
attribute (a JSON object, :data:`FIELDS`): the engine and its version, its parallel layout,
the weights' quantization, the aux layer ids and what confirmed them, the final-state
convention, the compute dtype, and the tokenizer's and chat template's hashes. The
validator, the loader (and so every export and the draft check) refuse a dataset whose
shards disagree on it, naming the fields; ``eagle3data-status`` shows it.

Shards written before the fingerprint existed have none, and say nothing: they differ from
no fingerprint, so a run upgraded midway keeps the shards it made (the manifest takes the
fingerprint of the shards that have one).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

ATTR = "capture_fingerprint"

# Every field, in the order they are shown.
FIELDS = (
    "engine",  # "transformers 5.23.0", "sglang 0.5.23", "vllm 0.32.0"
    "layout",  # where and how parallel: "cpu", "cuda x8", "tp 8, dp 2 (dp attention)", ...
    "weights_quantization",  # the checkpoint's quant_method, or "none"
    "aux_layer_ids",  # 0-based decoder layer outputs
    "aux_layers_confirmed_by",  # what says the engine captured those layers
    "final_state",
    "compute_dtype",
    "tokenizer_hash",
    "chat_template_hash",
)


def fingerprint_attr(fingerprint: Mapping[str, Any]) -> str:
    """The attribute's value: the fields as canonical JSON."""
    missing = [f for f in FIELDS if f not in fingerprint]
    if missing:
        raise ValueError(f"capture fingerprint lacks {missing}")
    return json.dumps({f: fingerprint[f] for f in FIELDS}, sort_keys=True)


def fingerprint_of(attrs: Mapping[str, Any]) -> dict[str, Any] | None:
    """The fingerprint a shard's attributes (or a manifest's ``attrs``) hold; None for
    data written before it existed."""
    value = attrs.get(ATTR)
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode()
    return dict(json.loads(value)) if isinstance(value, str) else dict(value)


def differences(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> list[str]:
    """``field: a vs b`` for each field that differs; none where either is data written
    before the fingerprint existed (module docstring)."""
    if a is None or b is None:
        return []
    return [f"{f}: {a.get(f)!r} vs {b.get(f)!r}" for f in FIELDS if a.get(f) != b.get(f)]


def first_fingerprint(shards: Sequence[tuple[str, Mapping[str, Any]]]) -> tuple[str, dict] | None:
    """(where, fingerprint) of the first of ``shards`` that has one."""
    for where, attrs in shards:
        found = fingerprint_of(attrs)
        if found is not None:
            return where, found
    return None


def mixed_fingerprint_errors(shards: Sequence[tuple[str, Mapping[str, Any]]]) -> list[str]:
    """One line per shard (``(where, attrs)``) whose fingerprint is not the first one's."""
    first = first_fingerprint(shards)
    if first is None:
        return []
    first_where, reference = first
    errors = []
    for where, attrs in shards:
        differ = differences(reference, fingerprint_of(attrs))
        if differ:
            errors.append(
                f"{where}: captured otherwise than {first_where} ({'; '.join(differ)}): one "
                f"dataset's shards must come from one capture; re-make the odd ones"
            )
    return errors


def describe(fingerprint: Mapping[str, Any] | None) -> str:
    """One line for people (the status command)."""
    if fingerprint is None:
        return "no capture fingerprint (shards written before it existed)"
    return (
        f"{fingerprint['engine']}, {fingerprint['layout']}, weights "
        f"{fingerprint['weights_quantization']}, {fingerprint['compute_dtype']}, aux layers "
        f"{fingerprint['aux_layer_ids']} ({fingerprint['aux_layers_confirmed_by']}), "
        f"{fingerprint['final_state']}"
    )
