"""No module of the package uses another module's private name (``_x``): what two modules
share is public and named so, and a rename of a private helper breaks nothing elsewhere.

Read from the source with ``ast``: ``from .m import _x`` and ``m._x`` where ``m`` is a module
of the package (imported as a module), in ``src/`` and ``scripts/``.
"""

from __future__ import annotations

import ast
from pathlib import Path

from support.workflow import REPO

SRC = REPO / "src"
PACKAGE = "eagle3data"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts) if path.is_relative_to(SRC) else []
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _absolute(node: ast.ImportFrom, here: str, is_package: bool) -> str:
    """The absolute module an ``ImportFrom`` imports from (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    base = here.split(".") if is_package else here.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _is_project_module(name: str) -> bool:
    if name != PACKAGE and not name.startswith(PACKAGE + "."):
        return False
    path = SRC.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def private_uses(source: str, here: str, *, is_package: bool = False) -> list[str]:
    """``line: name`` for each private name of another project module that ``source`` (the
    module ``here``) uses."""
    tree = ast.parse(source)
    modules: set[str] = set()  # local names bound to a project module
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_project_module(alias.name):
                    modules.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            origin = _absolute(node, here, is_package)
            if not _is_project_module(origin) or origin == here:
                continue
            for alias in node.names:
                if _is_private(alias.name):
                    found.append(f"{node.lineno}: {origin}.{alias.name}")
                elif _is_project_module(f"{origin}.{alias.name}"):
                    modules.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and _is_private(node.attr)
        ):
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_name() -> None:
    files = sorted([*(SRC / PACKAGE).rglob("*.py"), *(REPO / "scripts").glob("*.py")])
    assert len(files) > 20
    uses = [
        f"{path.relative_to(REPO)}:{use}"
        for path in files
        for use in private_uses(
            path.read_text(encoding="utf-8"),
            _module_name(path),
            is_package=path.name == "__init__.py",
        )
    ]
    assert uses == []


def test_the_check_sees_both_forms() -> None:
    source = (
        "from ..hidden_states.final_state import _is_plain_rms\n"
        "from ..hidden_states import agreement\n"
        "from .. import target as t\n"
        "import eagle3data.loader as loader\n"
        "agreement._tensor_names\n"
        "t._anything\n"
        "loader._x\n"
        "agreement.__name__\n"
        "table._fingerprint\n"  # not a module
    )
    uses = [u.split(": ", 1)[1] for u in private_uses(source, "eagle3data.consumers.probe")]
    assert sorted(uses) == [
        "agreement._tensor_names",
        "eagle3data.hidden_states.final_state._is_plain_rms",
        "loader._x",
        "t._anything",
    ]
