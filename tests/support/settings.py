"""Settings as a shard job parses them, from a config validated against the schema (its
defaults filled in): tests give only the keys they are about."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3data.config import validate_config
from eagle3data.hidden_states.settings import CaptureSettings

SCHEMA = Path(__file__).resolve().parents[2] / "config" / "schema.yaml"


def validated_config(
    hidden_states: dict[str, Any] | None = None, model: dict[str, Any] | None = None
) -> dict[str, Any]:
    config = {
        "model": {"path": "model", **(model or {})},
        "datasets": {"A1": {"path": "prompts.jsonl"}},
        "hidden_states": dict(hidden_states or {}),
    }
    return validate_config(config, SCHEMA)


def capture_settings(model_dtype: str = "auto", **hidden_states: Any) -> CaptureSettings:
    """``hidden_states`` as given over the schema's defaults, ``model.dtype`` ``model_dtype``."""
    config = validated_config(hidden_states, {"dtype": model_dtype})
    return CaptureSettings.of_config(config)
