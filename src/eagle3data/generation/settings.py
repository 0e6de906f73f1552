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
from dataclasses import dataclass
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


@dataclass(frozen=True)
class GenerationSettings:
    """The ``generation`` section as a generate job reads it, parsed once at the job's
    edge (:meth:`parse`) and passed down: every default is the schema's, filled in when
    the config was validated.

    ``content`` is :func:`generation_settings` verbatim (the rule's params): the journal's
    key is a hash of it, so it is kept as it came rather than rebuilt from the fields."""

    content: Mapping[str, Any]
    backend: str
    model: str  # the name recorded in the rows
    model_path: str
    dtype: str
    chat_template_kwargs: Mapping[str, Any]
    seed: int
    sampling: Mapping[str, Any]
    batch_size: int | None  # the in-process backend's; None for HTTP
    served_model: str | None  # HTTP only
    extra_body: Mapping[str, Any]  # HTTP only (empty for the in-process backend)
    # How to run (execution_settings): none of these changes what is generated.
    device: str
    endpoints: tuple[str, ...]
    api_key_env: str | None
    concurrency: int
    request_timeout_s: float
    max_retries: int
    max_consecutive_failures: int
    max_error_rate: float
    progress_interval_s: float
    return_token_ids: bool
    trust_remote_code: bool

    @classmethod
    def parse(cls, settings: Mapping[str, Any], execution: Mapping[str, Any]) -> GenerationSettings:
        """From the rule's ``params.settings`` (:func:`generation_settings`, JSON-decoded)
        and :func:`execution_settings` of the validated config."""
        return cls(
            content=dict(settings),
            backend=settings["backend"],
            model=settings["model"],
            model_path=settings["model_path"],
            dtype=settings["dtype"],
            chat_template_kwargs=dict(settings["chat_template_kwargs"]),
            seed=int(settings["seed"]),
            sampling=dict(settings["sampling"]),
            batch_size=settings.get("batch_size"),  # absent for HTTP (not in the key)
            served_model=settings.get("served_model"),  # absent in-process (likewise)
            extra_body=dict(settings.get("extra_body") or {}),
            device=execution["device"],
            endpoints=tuple(execution["endpoints"]),
            api_key_env=execution["api_key_env"],
            concurrency=int(execution["concurrency"]),
            request_timeout_s=float(execution["request_timeout_s"]),
            max_retries=int(execution["max_retries"]),
            max_consecutive_failures=int(execution["max_consecutive_failures"]),
            max_error_rate=float(execution["max_error_rate"]),
            progress_interval_s=float(execution["progress_interval_s"]),
            return_token_ids=bool(execution["return_token_ids"]),
            trust_remote_code=bool(execution["trust_remote_code"]),
        )

    @classmethod
    def of_config(cls, config: Mapping[str, Any]) -> GenerationSettings:
        """From a validated config (its defaults filled in)."""
        return cls.parse(generation_settings(config), execution_settings(config))

    def key(self) -> str:
        """The journal's key (:func:`generation_key`): reads the model's files."""
        return generation_key(self.content, model_fingerprint(self.model_path))
