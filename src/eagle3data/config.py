"""The workflow config as rules, scripts and commands read it.

``canonical_json`` is the one spelling of a value that rules use for their params (so
reordered YAML re-runs nothing) and that content hashes are taken of (sidecar keys,
prompt hashes): changing it would re-key every journal, so it never changes.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import ConfigError, UserError
from .schema import PACKAGE_SCHEMA
from .units import parse_count


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def content_hash(obj: Any, length: int = 16) -> str:
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()[:length]


def model_name(model_cfg: Mapping[str, Any]) -> str:
    """The name recorded in response rows and shard attributes."""
    return model_cfg.get("name") or Path(model_cfg["path"]).name


def schema_for(workdir: Path) -> Path:
    """The schema a workflow directory's Snakefile validates with (its
    ``config/schema.yaml``), else this checkout's: never one beside a config file,
    which may live anywhere (``--config ~/whatif.yaml``)."""
    own = workdir / "config" / "schema.yaml"
    return own if own.is_file() else PACKAGE_SCHEMA


def validate_config(config: dict[str, Any], schema: Path) -> dict[str, Any]:
    """``config`` checked against ``schema`` and the rules between its keys, its defaults
    filled in (in place)."""
    from snakemake.utils import validate

    validate(config, str(schema))
    raise_problems(spell_counts(config) + cross_key_problems(config))
    return config


# Counts as people write them: `10M`, `10_000_000` and `10000000` are one budget. The schema
# lets these keys be such strings; they become integers here, in place, before anything reads
# them (rule params, settings, the status command), so respelling one re-runs nothing.
DATASET_COUNT_KEYS = ("token_budget", "max_samples")


def spell_counts(config: dict[str, Any]) -> list[str]:
    """``datasets.*.token_budget`` and ``max_samples`` written as ``10M`` or ``"10_000_000"``
    made integers (in place, as :func:`eagle3data.units.parse_count` reads them); the
    problems of those that are not whole counts."""
    problems = []
    for name, dataset in (config.get("datasets") or {}).items():
        for key in DATASET_COUNT_KEYS:
            value = dataset.get(key)
            if not isinstance(value, str):
                continue
            try:
                dataset[key] = parse_count(value)
            except ValueError as exc:
                problems.append(f"datasets.{name}.{key}: {exc}")
    return problems


# speculators 0.9.0's `--hidden-states-dtype` takes these only (it refuses float16).
SPECULATORS_DTYPES = ("bfloat16", "float32")


def cross_key_problems(config: Mapping[str, Any]) -> list[str]:
    """What the schema cannot say in one line: keys whose values cannot go together
    (``config`` validated, its defaults filled in). A later stage's key is checked here too,
    so that a run does not find it missing after days of generation."""
    export = config["export"]
    problems = []
    if export["speculators"] and export["dtype"] not in SPECULATORS_DTYPES:
        problems.append(
            f"export.dtype: {export['dtype']} cannot go with export.speculators: true "
            f"(speculators trains on {' or '.join(SPECULATORS_DTYPES)} hidden states only); "
            f"set export.dtype to one of them or export.speculators to false"
        )
    return problems + _capture_server_problems(config) + _gpu_problems(config)


def _capture_server_problems(config: Mapping[str, Any]) -> list[str]:
    """``hidden_states.backend: vllm`` reads every state from the server at
    ``hidden_states.vllm.url``: without one the first shard job would fail, after generation."""
    hidden = config["hidden_states"]
    if hidden["backend"] != "vllm":
        return []
    url = (hidden.get("vllm") or {}).get("url")
    if not url:
        return [
            "hidden_states.vllm.url: not set, and hidden_states.backend: vllm captures through "
            "that server: name its OpenAI base URL, e.g. http://localhost:8000/v1 "
            "(docs/how-to/vllm.md, 'Start the capture server')"
        ]
    if not re.match(r"^https?://[^/\s]+", str(url)):
        return [
            f"hidden_states.vllm.url: {url!r} is not an http(s) URL; name the capture "
            f"server's OpenAI base URL, e.g. http://localhost:8000/v1"
        ]
    return []


def _gpu_problems(config: Mapping[str, Any]) -> list[str]:
    """GPUs a generate or hidden-state job takes against its layout and ``gpus.count``,
    where both are given (``auto`` asks the machine, which the driver may not be)."""
    from .gpu_slots import job_gpus

    count = config["gpus"]["count"]
    problems = []
    for stage in ("generation", "hidden_states"):
        if config[stage]["gpus_per_job"] == "auto" and count == "auto":
            continue  # resolved by the rules, from the machine itself
        try:
            gpus = job_gpus(config, stage)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        if count != "auto" and gpus > int(count):
            problems.append(
                f"gpus.count: {count}, and one {stage} job takes {gpus} GPUs "
                f"({stage}.gpus_per_job, or the sglang layout): it could never start; raise "
                f"gpus.count to the machine's GPUs or shrink the job"
            )
    return problems


def model_problems(config: Mapping[str, Any]) -> list[str]:
    """What the capture will ask of the model directory, asked of its ``config.json`` now:
    the aux layers for its depth, and what the SGLang engine would refuse (the layer ids its
    model numbers otherwise, ``hidden_states.sglang.extra_args`` the capture sets itself).
    A directory without ``config.json`` is left to the Snakefile's file check (and the
    demo model to the rule that makes it)."""
    from . import model_config
    from .hidden_states.layers import resolve_aux_layers

    model_dir = Path(config["model"]["path"])
    if not (model_dir / "config.json").is_file():
        return []
    hidden = config["hidden_states"]
    try:
        raw = model_config.read_model_config(model_dir)
    except (UserError, ValueError) as exc:  # ValueError: not JSON
        return [f"model.path: {model_dir / 'config.json'}: {exc}"]
    try:
        depth = model_config.num_hidden_layers(raw)
    except UserError:
        # A config without a depth (a stand-in for the prompt stages, a wrapper we cannot
        # read): the capture names it when it needs it; a prompts-only run must not fail.
        return []
    try:
        aux = resolve_aux_layers(hidden["aux_layers"], depth, hidden["aux_layer_convention"])
    except UserError as exc:
        return [f"hidden_states.aux_layers: {exc} ({model_dir / 'config.json'})"]
    sglang = hidden.get("sglang") or {}
    explicit = hidden["aux_layers"] != "auto"
    if hidden["backend"] != "sglang" or not (explicit or sglang.get("extra_args")):
        return []  # the rule's own ids, and no extra engine arguments: nothing to refuse
    # Only here: the module imports torch, which a parse of every other config skips.
    from .hidden_states.sglang_capture import engine_kwargs, sglang_layer_ids

    try:
        layer_ids = sglang_layer_ids(aux, model_config.architectures(raw))
    except UserError as exc:
        return [f"hidden_states.aux_layers: {exc}"]
    try:
        engine_kwargs(str(model_dir), dtype="auto", layer_ids=layer_ids, options=sglang)
    except UserError as exc:
        return [str(exc)]
    return []


def environment_problems(config: Mapping[str, Any], rule_env: Path | None = None) -> list[str]:
    """The packages that what ``config`` enables imports and its jobs will lack: a run must
    not find out at its end (the exports run last). Without ``rule_env``, the jobs run in
    this environment: looked up here without importing. With it (Snakemake deploying conda
    environments), they run in the conda environment that file declares, which may not
    exist yet: the packages must be among those it lists."""
    from .consumers.requirements import (
        SPECULATORS,
        SPECULATORS_DOCS,
        SPECULATORS_EXPORT,
        declared_packages,
        install_hint,
        missing_packages,
    )

    # The key that enables each, and what it imports beyond the core install.
    needs = [
        ("export.speculators", config["export"]["speculators"], SPECULATORS_EXPORT),
        ("draft_check.enabled", config.get("draft_check", {}).get("enabled"), (SPECULATORS,)),
    ]
    problems = []
    for key, enabled, packages in needs:
        if not enabled:
            continue
        if rule_env is not None:
            listed = declared_packages(rule_env)
            missing = [p for p in packages if p.distribution not in listed]
            if missing:
                problems.append(
                    f"{key}: true needs {', '.join(p.module for p in missing)} in its jobs' "
                    f"conda environment ({rule_env.name}), which does not list them: add "
                    f"them to its pip section, or run without --software-deployment-method "
                    f"conda ({SPECULATORS_DOCS})"
                )
            continue
        missing = missing_packages(packages)
        if missing:
            problems.append(
                f"{key}: true needs {', '.join(p.module for p in missing)}, not installed "
                f"here: {install_hint(missing)} ({SPECULATORS_DOCS})"
            )
    return problems


def raise_problems(problems: list[str]) -> None:
    """One line naming every problem, as the user error the job runner and Snakemake show."""
    if problems:
        raise ConfigError("invalid config: " + "; ".join(problems))


def check_config(config: dict[str, Any], rule_env: Path | None = None) -> None:
    """The checks the Snakefile makes after the schema's, before any job: counts spelled as
    integers (in place), the rules between keys, what the capture will ask of the model
    directory, and the packages what the config enables needs where its jobs run
    (``rule_env``: the conda environment file of the jobs that import them, when Snakemake
    deploys conda environments; see :func:`environment_problems`)."""
    problems = spell_counts(config) + cross_key_problems(config)
    raise_problems(problems + model_problems(config) + environment_problems(config, rule_env))


def load_config(path: Path, schema: Path | None = None) -> dict[str, Any]:
    """The workflow's config with the schema's defaults, as the Snakefile sees it
    (``schema``: default, this checkout's)."""
    import yaml

    return validate_config(yaml.safe_load(path.read_text()), schema or PACKAGE_SCHEMA)
