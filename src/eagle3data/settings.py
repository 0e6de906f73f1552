"""Config helpers: the content hashes that key sidecars, and model fingerprints.

A generation sidecar is keyed by everything that changes what the engine
returns for a prompt (model, backend, sampling, seed, chat-template variables)
and by nothing else: token_budget and max_samples only decide how much of it is
used, so changing them reuses the sidecar.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: Bump when the meaning of a sidecar record changes (invalidates old sidecars).
GENERATION_FORMAT = 1

# Files whose content defines the model's behaviour; weights are fingerprinted by
# name and size only, since hashing hundreds of GB of weights per job is not an option.
_MODEL_TEXT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def content_hash(obj: Any, length: int = 16) -> str:
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()[:length]


def model_fingerprint(model_path: str | Path) -> str:
    """Hash of a local model directory's config, tokenizer and weight layout."""
    root = Path(model_path)
    parts: dict[str, Any] = {}
    for name in _MODEL_TEXT_FILES:
        f = root / name
        if f.is_file():
            parts[name] = hashlib.sha256(f.read_bytes()).hexdigest()
    parts["weights"] = sorted(
        (f.name, f.stat().st_size)
        for f in root.iterdir()
        if f.is_file() and f.name.endswith(_WEIGHT_SUFFIXES)
    )
    return content_hash(parts)


def model_name(model_cfg: Mapping[str, Any]) -> str:
    return model_cfg.get("name") or Path(model_cfg["path"]).name


def generation_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The generation-relevant part of the config (what a params trigger should see).

    Where requests go (endpoints, concurrency, timeouts) is left out: moving a
    run to other servers must not discard its progress.
    """
    gen = config["generation"]
    settings = {
        "model": model_name(config["model"]),
        "model_path": config["model"]["path"],
        "dtype": config["model"]["dtype"],
        "chat_template_kwargs": config["model"]["chat_template_kwargs"],
        "backend": gen["backend"],
        "seed": gen["seed"],
        "sampling": gen["sampling"],
    }
    if gen["backend"] == "transformers":
        settings["batch_size"] = gen["batch_size"]
    else:
        settings["served_model"] = served_model(config)
        settings["extra_body"] = gen.get("extra_body", {})
    return settings


def served_model(config: Mapping[str, Any]) -> str:
    return config["generation"].get("served_model") or model_name(config["model"])


def generation_key(settings: Mapping[str, Any], fingerprint: str) -> str:
    """Sidecar key: settings that change engine output, plus the model fingerprint.

    The batch size is part of it for the in-process backend: batch composition
    changes padding and therefore (slightly) the numerics of what is generated.
    """
    keyed = {k: v for k, v in settings.items() if k != "model_path"}
    return content_hash({"format": GENERATION_FORMAT, "model_fingerprint": fingerprint, **keyed})


def read_model_config(model_path: str | Path) -> dict[str, Any]:
    """config.json as a dict (no transformers import: cheap planning jobs stay cheap)."""
    return json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))


def declared_dtype(model_config: Mapping[str, Any]) -> str:
    """The dtype a checkpoint declares; float32 if it declares none."""
    text_config = model_config.get("text_config") or {}
    for cfg in (model_config, text_config):
        for key in ("dtype", "torch_dtype"):
            value = cfg.get(key)
            if value in ("bfloat16", "float16", "float32"):
                return str(value)
    return "float32"


def hidden_size(model_config: Mapping[str, Any]) -> int:
    if "hidden_size" in model_config:
        return int(model_config["hidden_size"])
    return int(model_config["text_config"]["hidden_size"])


def resolve_dtype_name(requested: str, model_config: Mapping[str, Any]) -> str:
    return declared_dtype(model_config) if requested == "auto" else requested


def hidden_state_dtype(hidden_cfg: Mapping[str, Any], model_dtype: str) -> str:
    """The dtype hidden states are stored in, before resolving ``auto`` from the model."""
    return model_dtype if hidden_cfg["dtype"] == "auto" else hidden_cfg["dtype"]


def sidecar_path(work_dir: str | Path, dataset: str, key: str) -> Path:
    """The generation journal of ``dataset`` for settings ``key`` (work_dir: results/.work)."""
    return Path(work_dir) / "generate" / dataset / f"{key}.jsonl"
