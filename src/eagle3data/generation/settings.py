"""Which generation settings change what is generated, and the journal key they make.

A journal is keyed by everything that changes what the engine returns for a prompt
(model, backend, sampling, seed, chat-template variables) and by nothing else:
token_budget and max_samples only decide how much of it is used, so changing them
reuses the journal; where requests go (endpoints, concurrency, timeouts, the device)
only decides how it is made, so moving a run to other servers keeps its progress.
:func:`generation_settings` is also the generate rule's ``params.settings``, the
rerun trigger; :func:`execution_settings` is the rest, which triggers nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..config import content_hash, model_name

#: Bump when the meaning of a journal record changes (invalidates old journals).
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
    "tiktoken.model",  # Kimi's BPE ranks (its tokenizer is code: the *.py files below)
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")

# generation.* keys that say how a run goes, not what it produces.
EXECUTION_KEYS = (
    "device",
    "gpus_per_job",
    "endpoints",
    "api_key_env",
    "concurrency",
    "request_timeout_s",
    "max_retries",
    "max_consecutive_failures",
    "max_error_rate",
    "progress_interval_s",
    # Asks for the ids of what is generated; the text generated is the same either way.
    "return_token_ids",
)


def model_fingerprint(model_path: str | Path) -> str:
    """Hash of a local model directory's config, tokenizer and weight layout."""
    root = Path(model_path)
    parts: dict[str, Any] = {}
    for name in _MODEL_TEXT_FILES:
        f = root / name
        if f.is_file():
            parts[name] = hashlib.sha256(f.read_bytes()).hexdigest()
    for f in sorted(root.glob("*.py")):  # remote code: tokenizer, config, modeling
        parts[f.name] = hashlib.sha256(f.read_bytes()).hexdigest()
    parts["weights"] = sorted(
        (f.name, f.stat().st_size)
        for f in root.iterdir()
        if f.is_file() and f.name.endswith(_WEIGHT_SUFFIXES)
    )
    return content_hash(parts)


def generation_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The part of the config that changes generated content."""
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


def execution_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``generation.*`` settings that only say how to run (see EXECUTION_KEYS), and
    whether the model's own code may be loaded (``model.trust_remote_code``: it decides
    whether the model loads at all, never what it generates)."""
    gen = config["generation"]
    execution = {key: gen[key] for key in EXECUTION_KEYS if key in gen}
    execution["trust_remote_code"] = config["model"]["trust_remote_code"]
    return execution


def served_model(config: Mapping[str, Any]) -> str:
    return config["generation"].get("served_model") or model_name(config["model"])


def generation_key(settings: Mapping[str, Any], fingerprint: str) -> str:
    """Journal key: settings that change engine output, plus the model fingerprint.

    The batch size is part of it for the in-process backend: batch composition
    changes padding and therefore (slightly) the numerics of what is generated.
    """
    keyed = {k: v for k, v in settings.items() if k != "model_path"}
    return content_hash({"format": GENERATION_FORMAT, "model_fingerprint": fingerprint, **keyed})


def journal_key(config: Mapping[str, Any]) -> str:
    """The key of the journal the current config's generation writes."""
    return generation_key(generation_settings(config), model_fingerprint(config["model"]["path"]))
