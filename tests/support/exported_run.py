"""A finished workflow run with the trainers' exports on (tests/trainers/)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support.workflow import Workflow

DATASET = "A1"


@dataclass(frozen=True)
class ExportedRun:
    """A finished workflow with the exports on, and what its manifest says."""

    workflow: Workflow
    model_dir: Path
    manifest: dict[str, Any]

    def path(self, relative: str) -> Path:
        return self.workflow.path(relative)
