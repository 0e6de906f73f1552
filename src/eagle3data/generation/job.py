"""What a generate job is given (:class:`GenerationJob`, its :class:`Prompt` s) and what it
gives back (:class:`GenerationResult`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..schema import from_schema
from .budget import Selection
from .engines import Tools
from .records import JournalRecord


@dataclass(frozen=True)
class Prompt:
    id: str
    prompt_hash: str
    messages: list[dict[str, Any]]  # normalised (prompts stage): system/user/assistant/tool
    tools: Tools | None = None  # OpenAI tool specs offered to the target, if any


@dataclass
class GenerationJob:
    dataset: str
    prompts: Sequence[Prompt]  # in the seeded order
    journal: Path
    model: str
    sampling: Mapping[str, Any]
    seed: int = from_schema("generation", "seed")
    token_budget: int | None = None
    max_samples: int | None = None
    batch_size: int = from_schema("generation", "batch_size")
    progress_interval_s: float = from_schema("generation", "progress_interval_s")


@dataclass
class GenerationResult:
    rows: list[dict[str, Any]]
    stats: dict[str, Any]
    selection: Selection
    generated_now: int = 0  # prompts sent to the engine by this run
    failures: list[dict[str, Any]] = field(default_factory=list)
    # Every record of the current prompts (used by the output or not): the outcomes in
    # journal order, then the abandoned records.
    records: list[JournalRecord] = field(default_factory=list)
