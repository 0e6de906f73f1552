"""What the exports import beyond this package's own dependencies, checked before any work.

speculators and its data package hs-connectors are installed ``--no-deps`` beside this
package (their pins conflict with ours: docs/how-to/install.md), and ``datasets`` comes with
the test extra or sglang, not with the core install. Found missing only when the export checks
itself, they would cost the whole written folder, or, at the end of a run, days of
generation: so the workflow looks them up when it reads the config (``find_spec``, which
imports nothing) and the export imports them before it writes a file.

This module imports nothing heavy: the Snakefile calls it at parse time.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpeculatorsExportError


@dataclass(frozen=True)
class Package:
    """An import the exports need and the pip words that install it (README's)."""

    module: str  # the top-level module
    pip_name: str
    no_deps: bool  # installed --no-deps: its own pins conflict with ours

    @property
    def distribution(self) -> str:
        """The name an environment file lists it by, normalised (PEP 503)."""
        return normalised_name(re.split(r"[<>=!~\[ ;]", self.pip_name, maxsplit=1)[0])


SPECULATORS = Package("speculators", "speculators==0.9.0", no_deps=True)
HS_CONNECTORS = Package("hs_connectors", "hs-connectors==0.9.0", no_deps=True)
DATASETS = Package("datasets", "datasets", no_deps=False)

# What ``export.speculators`` imports: speculators' own reader checks the folder, through
# hs-connectors, and the rows are written with ``datasets``.
SPECULATORS_EXPORT = (SPECULATORS, HS_CONNECTORS, DATASETS)
# The modules the export's self-check imports (consumers/speculators_check.py): importing
# them at the start also finds what speculators itself lacks (it is installed without its
# deps).
SPECULATORS_EXPORT_IMPORTS = (
    "hs_connectors",
    "datasets",
    "speculators.data_generation.offline",
    "speculators.models.eagle3.model_definitions",
    "speculators.train.data",
    "speculators.train.recovery",
    "speculators.train.vocab_mapping",
    "speculators.utils.loading",
)
SPECULATORS_DOCS = "docs/how-to/training.md, 'speculators export'"


def normalised_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_packages(env_file: Path) -> set[str]:
    """The package names a conda environment file lists, conda's and pip's, normalised
    (read as YAML: the file is what Snakemake will build the environment from)."""
    import yaml

    spec = yaml.safe_load(env_file.read_text()) or {}
    names: set[str] = set()
    for dep in spec.get("dependencies") or []:
        entries = dep.get("pip", []) if isinstance(dep, dict) else [dep]
        for entry in entries:
            if isinstance(entry, str) and not entry.startswith("-"):
                # "pkg==1.0", "conda-forge::pkg=1.*", "pkg[extra]>=2"
                name = entry.split("::")[-1]
                names.add(normalised_name(re.split(r"[<>=!~\[ ;]", name, maxsplit=1)[0]))
    return names


def missing_packages(packages: Sequence[Package]) -> list[Package]:
    """Those of ``packages`` this environment cannot import, looked up without importing."""
    return [p for p in packages if importlib.util.find_spec(p.module) is None]


def install_hint(packages: Sequence[Package]) -> str:
    """The pip commands that install ``packages``, the ``--no-deps`` ones together."""
    no_deps = [p.pip_name for p in packages if p.no_deps]
    commands = [f"pip install --no-deps {' '.join(no_deps)}"] if no_deps else []
    commands += [
        f"pip install {p.pip_name} -c constraints/cpu.txt" for p in packages if not p.no_deps
    ]
    return " and ".join(f"`{c}`" for c in commands)


def require_speculators_export() -> None:
    """Import what the speculators export's self-check imports, or raise
    :class:`SpeculatorsExportError` with one line saying what to install: called before the
    export writes anything."""
    missing = missing_packages(SPECULATORS_EXPORT)
    if missing:
        raise SpeculatorsExportError(
            f"the speculators export needs {', '.join(p.module for p in missing)}, not "
            f"installed here: {install_hint(missing)} ({SPECULATORS_DOCS})"
        )
    for module in SPECULATORS_EXPORT_IMPORTS:
        try:
            importlib.import_module(module)
        except ImportError as exc:  # speculators comes without its deps: one may be missing
            raise SpeculatorsExportError(
                f"the speculators export checks itself with speculators' own code, and "
                f"{module} does not import ({exc}); install what it names, or "
                f"{install_hint(SPECULATORS_EXPORT)} ({SPECULATORS_DOCS})"
            ) from None
