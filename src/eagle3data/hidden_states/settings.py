"""Which hidden-state settings change the stored states, and which only say how to run.

:func:`hidden_state_settings` is the ``params.settings`` of the plan_shards and
hidden_states rules (their rerun trigger) and what their scripts read back; where and
on how many GPUs the states are computed does not change them, so those keys are left
out: adding them, or moving a run to another machine, re-runs nothing. Keys added
later are left out while they hold the value that stores what was stored before
(``storage_dtype: auto``, ``final_state: post_norm``), so such a value re-extracts
nothing after an upgrade; any other value changes
the states, and the settings, so shards are extracted again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .final_state import OLDER_FINAL_STATE, final_state_of

# hidden_states.* keys that say how a shard is computed, not what it holds.
EXECUTION_KEYS = (
    "gpus_per_job",
    "sglang",
    "vllm",
    "engine_lifetime",
    "engine_idle_s",
    "share_gpus_with_generation",
)
# Keys added after shards existed, and the default that keeps the old content.
_LATER_DEFAULTS = {"storage_dtype": "auto", "final_state": OLDER_FINAL_STATE}


def hidden_state_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    hidden = {
        k: v
        for k, v in config["hidden_states"].items()
        if k not in EXECUTION_KEYS and not (k in _LATER_DEFAULTS and v == _LATER_DEFAULTS[k])
    }
    return {"hidden_states": hidden, "dtype": config["model"]["dtype"]}


def execution_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``hidden_states.*`` settings that only say how to run (see EXECUTION_KEYS),
    and whether the model's own code may be loaded (``model.trust_remote_code``: it
    decides whether the model loads at all, never what the states are)."""
    execution = {k: v for k, v in config["hidden_states"].items() if k in EXECUTION_KEYS}
    execution["trust_remote_code"] = config["model"]["trust_remote_code"]
    return execution


@dataclass(frozen=True)
class CaptureSettings:
    """The ``hidden_states`` section as the capture reads it, parsed once at the job's edge
    (:meth:`parse`) and passed down: every default is the schema's, filled in when the
    config is validated; nothing below reads the section again."""

    backend: str
    aux_layers: str | tuple[int, ...]  # "auto" or the layer ids
    aux_layer_convention: str
    # The forward dtype before ``auto`` resolves from the checkpoint: hidden_states.dtype,
    # else model.dtype.
    dtype: str
    final_state: str
    storage_dtype: str | None  # None: the forward dtype
    device: str
    shard_bytes: int
    batch_tokens: int
    compression: str
    # Execution only (EXECUTION_KEYS and model.trust_remote_code): how, not what.
    trust_remote_code: bool
    engine_lifetime: str
    engine_idle_s: float
    sglang: Mapping[str, Any]
    vllm: Mapping[str, Any]

    @classmethod
    def parse(cls, settings: Mapping[str, Any], execution: Mapping[str, Any]) -> CaptureSettings:
        """From the rules' ``params.settings`` (:func:`hidden_state_settings`, JSON-decoded)
        and :func:`execution_settings`. The keys that settings leave out at the value older
        data holds (``_LATER_DEFAULTS``) come back at that value."""
        hidden = {**_LATER_DEFAULTS, **settings["hidden_states"], **execution}
        aux = hidden["aux_layers"]
        return cls(
            backend=hidden["backend"],
            aux_layers=aux if isinstance(aux, str) else tuple(int(i) for i in aux),
            aux_layer_convention=hidden["aux_layer_convention"],
            dtype=settings["dtype"] if hidden["dtype"] == "auto" else hidden["dtype"],
            final_state=final_state_of(hidden, "hidden_states settings"),
            storage_dtype=None if hidden["storage_dtype"] == "auto" else hidden["storage_dtype"],
            device=hidden["device"],
            shard_bytes=int(hidden["shard_bytes"]),
            batch_tokens=int(hidden["batch_tokens"]),
            compression=hidden["compression"],
            trust_remote_code=bool(hidden["trust_remote_code"]),
            engine_lifetime=hidden["engine_lifetime"],
            engine_idle_s=float(hidden["engine_idle_s"]),
            sglang=dict(hidden["sglang"]),
            vllm=dict(hidden["vllm"]),
        )

    @classmethod
    def of_config(cls, config: Mapping[str, Any]) -> CaptureSettings:
        """From a validated config (its defaults filled in)."""
        return cls.parse(hidden_state_settings(config), execution_settings(config))

    def to_json(self) -> dict[str, Any]:
        """What :meth:`from_json` reads back (a capture engine's spec file)."""
        out = dataclasses.asdict(self)
        if not isinstance(self.aux_layers, str):
            out["aux_layers"] = list(self.aux_layers)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CaptureSettings:
        aux = data["aux_layers"]
        return cls(**{**data, "aux_layers": aux if isinstance(aux, str) else tuple(aux)})
