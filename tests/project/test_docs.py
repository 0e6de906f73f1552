"""The README against the code: every config key the schema accepts (and no other), and
the layout tree of the package, one room per stage."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import yaml
from support.workflow import REPO


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


def readme_tree(readme: str) -> list[str]:
    """The names in the README's layout block under ``src/eagle3data/``."""
    block = readme.split("Layout, one line per room", 1)[1].split("```text\n", 1)[1]
    block = block.split("```", 1)[0]
    names: list[str] = []
    inside = False
    for line in block.splitlines():
        if line.startswith("src/eagle3data/"):
            inside = True
            continue
        if inside and not line.startswith("  "):
            break
        if inside:
            room = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
            names += [n.strip() for n in room.split(",")]
    return names


def test_readme_layout_tree_matches_the_package() -> None:
    package = REPO / "src" / "eagle3data"
    rooms = {
        p.name + "/" if p.is_dir() else p.name
        for p in package.iterdir()
        if not p.name.startswith(("_", ".")) and p.name != "py.typed"
    }
    listed = readme_tree((REPO / "README.md").read_text())
    assert len(listed) == len(set(listed)), "each room once"
    assert sorted(listed) == sorted(rooms)


def test_each_rule_file_runs_one_package() -> None:
    """A stage is one rule file, one thin script (one call) and one package."""
    for rule_file in sorted((REPO / "rules").glob("*.smk")):
        scripts = re.findall(r'"\.\./scripts/([\w.]+)"', rule_file.read_text())
        homes = set()
        for script in scripts:
            text = (REPO / "scripts" / script).read_text()
            assert text.count("run_step(") == 1, script
            stage_imports = re.findall(r"from eagle3data\.(\w+)(?:\.\w+)* import", text)
            helpers = {"jobs", "gpu_slots", "config"}
            homes |= {m for m in stage_imports if m not in helpers}
        if scripts:
            assert len(homes) == 1, (rule_file.name, homes)
