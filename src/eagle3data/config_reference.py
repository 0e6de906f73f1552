"""The configuration reference page, rendered from ``config/schema.yaml`` alone.

The schema is the one source of every key's type, default and meaning: the validator reads
it, and this module writes it out as ``docs/reference/config.md`` (checked in, so the docs
build needs no step of its own; ``tests/project/test_docs.py`` checks it is up to date).

    python -m eagle3data.config_reference           # rewrite docs/reference/config.md
    python -m eagle3data.config_reference --check   # exit 1 when it is out of date

One section per object of the schema that has keys of its own (``model``,
``generation.sampling``, ``datasets.{name}.fields``, ...): its description, then a table of
its leaves with their full dotted path (dataset names as ``{name}``), type, default and
description. A ``docs/PAGE.md`` or ``docs/PAGE.md#anchor`` named in a description becomes a
link, so the docs build checks it too.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .config import PACKAGE_SCHEMA

REPO = PACKAGE_SCHEMA.parents[1]
PAGE = REPO / "docs" / "reference" / "config.md"
REGENERATE = "python -m eagle3data.config_reference"

# A docs page named in a description: `docs/how-to/sglang.md` or `docs/x.md#anchor`.
DOCS_PAGE = re.compile(r"docs/((?:[\w-]+/)*[\w-]+\.md)(#[\w-]+)?")


@dataclass(frozen=True)
class Leaf:
    path: str
    node: dict[str, Any]
    required: bool


@dataclass(frozen=True)
class Section:
    path: str
    description: str
    leaves: list[Leaf]


def children(node: dict[str, Any]) -> dict[str, Any] | None:
    """The keys below an object node: its ``properties``, or for a map of named entries
    (``datasets``) the properties every entry has, under the single key ``{name}``."""
    if node.get("properties"):
        return node["properties"]
    extra = node.get("additionalProperties")
    if isinstance(extra, dict) and extra.get("properties"):
        return {"{name}": extra}
    return None


def sections(node: dict[str, Any], path: str = "") -> Iterator[Section]:
    """Every object with keys of its own, depth first in schema order."""
    keys = children(node) or {}
    required = set(node.get("required", ()))
    leaves = [
        Leaf(f"{path}.{key}" if path else key, child, key in required)
        for key, child in keys.items()
        if children(child) is None
    ]
    if path and (leaves or node.get("description")):
        yield Section(path, clean(node.get("description", "")), leaves)
    for key, child in keys.items():
        if children(child) is not None:
            yield from sections(child, f"{path}.{key}" if path else key)


def schema_leaves(schema: dict[str, Any]) -> list[str]:
    """Dotted paths of every leaf of the schema (what the page must cover)."""
    return [leaf.path for section in sections(schema) for leaf in section.leaves]


def clean(text: str) -> str:
    """One line: YAML's folded blocks keep their line breaks."""
    return " ".join(str(text).split())


def linked(text: str, page_dir: str = "reference") -> str:
    """``docs/PAGE.md[#anchor]`` as a Markdown link relative to the generated page."""
    depth = len(Path(page_dir).parts)

    def link(match: re.Match[str]) -> str:
        target, anchor = match.group(1), match.group(2) or ""
        return f"[{target}]({'../' * depth}{target}{anchor})"

    return DOCS_PAGE.sub(link, text)


def cell(text: str) -> str:
    """Text safe inside a table cell."""
    return text.replace("|", "\\|")


def literal(value: Any) -> str:
    """A value as the config file would write it (YAML flow style, JSON scalars)."""
    if isinstance(value, str):
        return value
    return json.dumps(value)


def type_text(node: dict[str, Any]) -> str:
    if "enum" in node:
        return "one of " + ", ".join(f"`{literal(v)}`" for v in node["enum"])
    if "const" in node:
        return f"`{literal(node['const'])}`"
    for combinator in ("oneOf", "anyOf"):
        if combinator in node:
            return " or ".join(type_text(alternative) for alternative in node[combinator])
    types = node.get("type", "any")
    names = [types] if isinstance(types, str) else list(types)
    words = []
    for name in names:
        if name == "array" and "items" in node:
            name = f"list of {type_text(node['items'])}"
        elif name == "object" and isinstance(node.get("additionalProperties"), dict):
            name = f"map to {type_text(node['additionalProperties'])}"
        words.append(name)
    text = " or ".join(words)
    bounds = [
        f"{sign} {literal(node[key])}"
        for key, sign in (
            ("minimum", ">="),
            ("exclusiveMinimum", ">"),
            ("maximum", "<="),
            ("exclusiveMaximum", "<"),
        )
        if key in node
    ]
    if "minItems" in node and node.get("minItems") == node.get("maxItems"):
        bounds.append(f"{node['minItems']} items")
    elif "minItems" in node:
        bounds.append(f"at least {node['minItems']} item(s)")
    return f"{text} ({', '.join(bounds)})" if bounds else text


def default_text(leaf: Leaf) -> str:
    if "default" in leaf.node:
        return f"`{literal(leaf.node['default'])}`"
    return "required" if leaf.required else "(none)"


def render(schema: dict[str, Any]) -> str:
    """The whole page."""
    lines = [
        "# Configuration",
        "",
        "<!-- Generated from config/schema.yaml by `"
        + REGENERATE
        + "`: edit the schema, then run it. -->",
        "",
        linked(clean(schema.get("description", ""))),
        "",
        "Every key, its type, its default and what it does, in the order of the schema. Dataset "
        "names appear as `{name}`.",
    ]
    for section in sections(schema):
        lines += ["", f"## `{section.path}`"]
        if section.description:
            lines += ["", linked(section.description)]
        if not section.leaves:
            continue
        lines += ["", "| key | type | default | description |", "|---|---|---|---|"]
        for leaf in section.leaves:
            description = linked(clean(leaf.node.get("description", "")))
            lines.append(
                f"| `{leaf.path}` | {cell(type_text(leaf.node))} | {cell(default_text(leaf))} "
                f"| {cell(description)} |"
            )
    return "\n".join(lines) + "\n"


def load_schema(path: Path = PACKAGE_SCHEMA) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schema", type=Path, default=PACKAGE_SCHEMA)
    parser.add_argument("--out", type=Path, default=PAGE)
    parser.add_argument(
        "--check", action="store_true", help="exit 1, writing nothing, when --out is out of date"
    )
    args = parser.parse_args(argv)
    page = render(load_schema(args.schema))
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != page:
            print(f"{args.out} is out of date: run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
