"""The schema is the one place a config default is written: a settings dataclass whose field
is named like a config key never repeats that key's default as a literal (it takes it with
``eagle3data.schema.from_schema``, so the two cannot drift apart). Read from the source with
``ast``. A field that only shares a key's name (``GpuLease.count``, GPUs held, against
``gpus.count``) has another default and is not a copy."""

from __future__ import annotations

import ast
import json
from collections.abc import Iterator
from typing import Any

import yaml
from support.workflow import REPO

from eagle3data.schema import PACKAGE_SCHEMA

SRC = REPO / "src"


def as_json(value: Any) -> str:
    """A default as JSON, numbers as floats (600 and 600.0 are the same timeout), a tuple
    as the list it stands for."""
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, int | float) and not isinstance(value, bool):
        value = float(value)
    return json.dumps(value)


def config_defaults(node: dict[str, Any]) -> set[tuple[str, str]]:
    """(key, its default as JSON) for every key with a scalar or list default anywhere in
    the schema."""
    found = set()
    for name, sub in (node.get("properties") or {}).items():
        if "default" in sub and not isinstance(sub["default"], dict):
            found.add((name, as_json(sub["default"])))
        found |= config_defaults(sub)
    return found


def is_dataclass(cls: ast.ClassDef) -> bool:
    for deco in cls.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name == "dataclass":
            return True
    return False


def literal_defaults(source: str) -> Iterator[tuple[str, int, str, str]]:
    """(class, line, field, default as JSON) of each dataclass field with a literal default."""
    for cls in ast.walk(ast.parse(source)):
        if not isinstance(cls, ast.ClassDef) or not is_dataclass(cls):
            continue
        for stmt in cls.body:
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and stmt.value is not None
            ):
                try:
                    value = ast.literal_eval(stmt.value)
                except ValueError:
                    continue  # computed: from_schema(...), field(...), a constant's name
                if value is not None:  # None: "not set", not a config value
                    yield cls.name, stmt.lineno, stmt.target.id, as_json(value)


def test_no_settings_dataclass_repeats_a_config_default() -> None:
    defaults = config_defaults(yaml.safe_load(PACKAGE_SCHEMA.read_text()))
    repeated = [
        f"{path.relative_to(REPO)}:{line} {cls}.{name} = {value}"
        for path in sorted(SRC.rglob("*.py"))
        for cls, line, name, value in literal_defaults(path.read_text())
        if (name, value) in defaults
    ]
    assert not repeated, "defaults written beside the schema's: " + ", ".join(repeated)


def test_the_check_sees_a_repeated_default() -> None:
    source = (
        "@dataclass(frozen=True)\nclass S:\n    concurrency: int = 64\n"
        "    seeds: tuple = (0, 1, 2)\n"
    )
    found = list(literal_defaults(source))
    assert found == [("S", 3, "concurrency", "64.0"), ("S", 4, "seeds", "[0, 1, 2]")]
    defaults = config_defaults(yaml.safe_load(PACKAGE_SCHEMA.read_text()))
    assert {(name, value) for _, _, name, value in found} <= defaults
    computed = '@dataclass\nclass S:\n    concurrency: int = from_schema("generation", "x")\n'
    assert list(literal_defaults(computed)) == []


def absent_final_state_defaults(source: str) -> Iterator[tuple[int, str]]:
    """(line, code) of each place that says what an absent ``final_state`` means: a
    ``.get("final_state", default)`` or a ``final_state`` parameter with a default."""
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and len(node.args) == 2
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value == "final_state"
        ):
            yield node.lineno, ast.unparse(node)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            positional = args.posonlyargs + args.args
            with_defaults = positional[len(positional) - len(args.defaults) :]
            pairs = list(zip(with_defaults, args.defaults, strict=True))
            keywords = zip(args.kwonlyargs, args.kw_defaults, strict=True)
            pairs += [(a, d) for a, d in keywords if d is not None]
            for arg, default in pairs:
                if arg.arg == "final_state":
                    yield node.lineno, f"{node.name}(final_state={ast.unparse(default)})"


def test_what_an_absent_final_state_means_is_said_in_one_place() -> None:
    """Two meanings meet in ``final_state``: a new config's default (the schema's,
    pre_norm) and what data written before the key holds (post_norm). Only
    ``hidden_states/final_state.py`` may say the second (``OLDER_FINAL_STATE``); a default
    anywhere else is one of the two written again, and drifts (issue 41: ``backends.py``
    read a missing key as post_norm). Parameters default to the schema's (``PRE_NORM``)
    or to None ("not set")."""
    allowed = SRC / "eagle3data" / "hidden_states" / "final_state.py"
    found = [
        f"{path.relative_to(REPO)}:{line} {code}"
        for path in sorted(SRC.rglob("*.py"))
        if path != allowed
        for line, code in absent_final_state_defaults(path.read_text())
        if not code.endswith(("(final_state=PRE_NORM)", "(final_state=None)"))
    ]
    assert not found, "final_state defaults outside final_state.py: " + ", ".join(found)
