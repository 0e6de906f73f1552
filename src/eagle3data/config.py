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


def load_config(path: Path) -> dict[str, Any]:
    """The workflow's config with the schema's defaults, as the Snakefile sees it."""
    import yaml
    from snakemake.utils import validate

    config = yaml.safe_load(path.read_text())
    validate(config, str(path.parent / "schema.yaml"))
    return config
