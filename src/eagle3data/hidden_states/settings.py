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

from collections.abc import Mapping
from typing import Any

from .final_state import OLDER_FINAL_STATE

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
    execution["trust_remote_code"] = config["model"].get("trust_remote_code", False)
    return execution


def storage_dtype(hidden_cfg: Mapping[str, Any]) -> str | None:
    """``hidden_states.storage_dtype``: None (``auto``, absent) stores the forward dtype."""
    value = hidden_cfg.get("storage_dtype", "auto")
    return None if value == "auto" else value


def hidden_state_dtype(hidden_cfg: Mapping[str, Any], model_dtype: str) -> str:
    """The dtype hidden states are computed and stored in, before ``auto`` is resolved
    from the model (``hidden_states.dtype``, defaulting to ``model.dtype``)."""
    return model_dtype if hidden_cfg["dtype"] == "auto" else hidden_cfg["dtype"]
