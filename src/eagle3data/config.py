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
    """``config`` checked against ``schema``, its defaults filled in (in place)."""
    from snakemake.utils import validate

    validate(config, str(schema))
    return config


def load_config(path: Path, schema: Path | None = None) -> dict[str, Any]:
    """The workflow's config with the schema's defaults, as the Snakefile sees it
    (``schema``: default, this checkout's)."""
    import yaml

    return validate_config(yaml.safe_load(path.read_text()), schema or PACKAGE_SCHEMA)
