"""The workflow's config schema (``config/schema.yaml``): the one place a default is
written. Imports nothing of this package, so any module may read a default from it."""

from __future__ import annotations

import copy
import dataclasses
import functools
from pathlib import Path
from typing import Any

# The schema of this checkout of the workflow (src/eagle3data/ -> config/schema.yaml).
PACKAGE_SCHEMA = Path(__file__).resolve().parents[2] / "config" / "schema.yaml"


@functools.cache
def _package_schema() -> dict[str, Any]:
    import yaml

    return yaml.safe_load(PACKAGE_SCHEMA.read_text())


def schema_defaults(*section: str) -> dict[str, Any]:
    """The schema's defaults for the keys of ``section`` (e.g. ``"hidden_states",
    "sglang"``): for code given part of a section by hand (a backend built in a test or a
    benchmark), so that the schema stays the one place a default is written."""
    node = _package_schema()
    for key in section:
        node = node["properties"][key]
    defaults = {k: v["default"] for k, v in node["properties"].items() if "default" in v}
    return copy.deepcopy(defaults)  # the schema is read once: its values are not lent out


def from_schema(*path: str) -> Any:
    """A dataclass field whose default is the schema's for ``path`` (a section's keys, then
    the key): a settings object built by hand (tests, benchmarks) gets what a run would."""
    *section, key = path
    return dataclasses.field(default_factory=lambda: schema_defaults(*section)[key])
