"""The README documents every config key the schema accepts, and no key it refuses."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import yaml
from conftest import REPO


def schema_keys(node: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """Dotted paths of the schema's leaves; dataset names appear as ``{name}``."""
    props = node.get("properties")
    if props:
        for key, child in props.items():
            yield from schema_keys(child, f"{prefix}.{key}" if prefix else key)
        return
    for child in (node.get("patternProperties") or {}).values():
        yield from schema_keys(child, f"{prefix}.{{name}}")
        return
    extra = node.get("additionalProperties")
    if isinstance(extra, dict) and "properties" in extra:
        yield from schema_keys(extra, f"{prefix}.{{name}}")
        return
    yield prefix


def documented_keys(readme: str) -> set[str]:
    """Keys in the first column of the README's config tables. ``a.b.c` / `d``
    is shorthand for ``a.b.c`` and its sibling ``a.b.d``."""
    keys = set()
    for line in readme.splitlines():
        if not line.startswith("| `"):
            continue
        names = re.findall(r"`([^`]+)`", line.split("|")[1])
        if not names or "." not in names[0]:
            continue
        parent = names[0].rsplit(".", 1)[0]
        keys.add(names[0])
        keys.update(n if "." in n else f"{parent}.{n}" for n in names[1:])
    return keys


def test_readme_config_tables_match_the_schema() -> None:
    schema = yaml.safe_load((REPO / "config" / "schema.yaml").read_text())
    readme = (REPO / "README.md").read_text()
    in_schema = set(schema_keys(schema))
    in_readme = {k for k in documented_keys(readme) if k.split(".")[0] in schema["properties"]}
    assert sorted(in_schema - in_readme) == [], "schema keys missing from the README tables"
    assert sorted(in_readme - in_schema) == [], "README documents keys the schema refuses"
