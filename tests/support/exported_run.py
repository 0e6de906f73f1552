"""Finished workflow runs with the exports on, shared by several test files (tests/conftest.py)."""

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


@dataclass(frozen=True)
class ConsumersRun:
    """The consumer rules' run of tests/conftest.py and what each of its steps left."""

    workflow: Workflow
    dry_run: str  # `snakemake -n` before anything ran: the default config, exports off
    manifests_after_vocab: list[str]  # the manifests the draft vocabulary target alone made
    vocab_log: str  # the draft_vocab job's log after that target
    exports: dict[str, bool]  # the export section of the last run
