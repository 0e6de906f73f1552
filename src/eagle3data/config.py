"""The workflow config as rules, scripts and commands read it.

``canonical_json`` is the one spelling of a value that rules use for their params (so
reordered YAML re-runs nothing) and that content hashes are taken of (sidecar keys,
prompt hashes): changing it would re-key every journal, so it never changes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import ConfigError


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def content_hash(obj: Any, length: int = 16) -> str:
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()[:length]


def model_name(model_cfg: Mapping[str, Any]) -> str:
    """The name recorded in response rows and shard attributes."""
    return model_cfg.get("name") or Path(model_cfg["path"]).name


# The schema of this checkout of the workflow (src/eagle3data/ -> config/schema.yaml).
PACKAGE_SCHEMA = Path(__file__).resolve().parents[2] / "config" / "schema.yaml"


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
    raise_problems(cross_key_problems(config))
    return config


# speculators 0.9.0's `--hidden-states-dtype` takes these only (it refuses float16).
SPECULATORS_DTYPES = ("bfloat16", "float32")


def cross_key_problems(config: Mapping[str, Any]) -> list[str]:
    """What the schema cannot say in one line: keys whose values cannot go together
    (``config`` validated, its defaults filled in)."""
    export = config["export"]
    problems = []
    if export["speculators"] and export["dtype"] not in SPECULATORS_DTYPES:
        problems.append(
            f"export.dtype: {export['dtype']} cannot go with export.speculators: true "
            f"(speculators trains on {' or '.join(SPECULATORS_DTYPES)} hidden states only); "
            f"set export.dtype to one of them or export.speculators to false"
        )
    return problems


def environment_problems(config: Mapping[str, Any]) -> list[str]:
    """The packages that what ``config`` enables imports and this environment lacks, looked
    up without importing them: a run must not find out at its end (the exports run last)."""
    from .consumers.requirements import (
        SPECULATORS,
        SPECULATORS_EXPORT,
        SPECULATORS_README,
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
        missing = missing_packages(packages) if enabled else []
        if missing:
            problems.append(
                f"{key}: true needs {', '.join(p.module for p in missing)}, not installed "
                f"here: {install_hint(missing)} ({SPECULATORS_README})"
            )
    return problems


def raise_problems(problems: list[str]) -> None:
    """One line naming every problem, as the user error the job runner and Snakemake show."""
    if problems:
        raise ConfigError("invalid config: " + "; ".join(problems))


def check_config(config: dict[str, Any]) -> None:
    """The checks the Snakefile makes after the schema's, before any job: the rules between
    keys and the packages what the config enables needs here."""
    raise_problems(cross_key_problems(config) + environment_problems(config))


def load_config(path: Path, schema: Path | None = None) -> dict[str, Any]:
    """The workflow's config with the schema's defaults, as the Snakefile sees it
    (``schema``: default, this checkout's)."""
    import yaml

    return validate_config(yaml.safe_load(path.read_text()), schema or PACKAGE_SCHEMA)
