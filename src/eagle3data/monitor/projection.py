"""Where a dataset will end under its current limits, and how fast it gets there.

The rate counts only the current run of the journal (its run file says when that run
took the journal, :mod:`..liveness`): records journaled by earlier runs say
nothing about this one, and a resumed run divided by a window full of old records
reads far too slow. While the run goes, the rate is that of the last
``RATE_WINDOW_S`` (never reaching back before the run began), ``None`` when nothing
was journaled in it (idle); a stopped run has no current rate, only the average of
its last run, which the projection may use (and says so).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import polars as pl

from ..liveness import Run
from .preview import HiddenStateEstimate
from .progress import DatasetProgress

RATE_WINDOW_S = 600.0  # the rate of a running job is measured over the last ten minutes


def current_rate(records: pl.DataFrame, run: Run, now: float) -> float | None:
    """Completion tokens per second that ``run`` journaled over the last ``RATE_WINDOW_S``
    (generated tokens, used or not: what the engine does); None when it journaled none."""
    start = max(now - RATE_WINDOW_S, run.started_at)
    if now <= start:
        return None
    # finished_at after the start only: a record finished before it was not this window's work.
    recent = records.filter(pl.col("finished_at") > start)
    tokens = int(recent["spent_tokens"].sum() or 0)
    return tokens / (now - start) if tokens else None


def last_run_rate(records: pl.DataFrame, run: Run) -> float | None:
    """The average rate of a run that has ended: its tokens over its span (to its end,
    or to its last record if it was killed before it could record one)."""
    ran = records.filter(pl.col("finished_at") >= run.started_at)
    if ran.height == 0:
        return None
    end = run.ended_at if run.ended_at is not None else float(ran["finished_at"].max())  # type: ignore[arg-type]
    tokens = int(ran["spent_tokens"].sum() or 0)
    return tokens / (end - run.started_at) if end > run.started_at and tokens else None


@dataclass(frozen=True)
class Projection:
    """Where a dataset ends under its limits; ``basis`` says how sure that is:
    ``decided`` (exact: the journal holds the whole prefix), ``extrapolated`` (the rest
    costs what the finished conversations did), ``lower bound`` (nothing generated yet;
    the budget alone), ``unknown`` (nothing generated and no budget)."""

    conversations: int | None
    completion_tokens: int | None
    hidden_state_bytes: int | None
    to_generate: int | None  # completion tokens still to generate
    seconds: float | None  # to generate them at ``rate``
    rate: float | None
    rate_basis: str | None  # "this run" (running) or "last run" (stopped)
    basis: str


def project(
    ds_cfg: Mapping[str, Any],
    progress: DatasetProgress | None,
    estimate: HiddenStateEstimate,
    rate: float | None,
    rate_basis: str | None,
) -> Projection:
    """The projection of one dataset from its progress and hidden-state estimate (the
    same numbers the dry run prints) and a rate."""
    budget, max_samples = ds_cfg.get("token_budget"), ds_cfg.get("max_samples")
    if progress is not None and progress.basis in ("decided", "extrapolated"):
        conversations, completion = (
            progress.expected_conversations,
            progress.expected_completion_tokens,
        )
        to_generate = completion - progress.completion_tokens
    else:
        prompts = None if progress is None else progress.prompts
        conversations = (
            None if max_samples is None or prompts is None else min(prompts, max_samples)
        )
        completion = to_generate = budget  # at most the budget (lower bound on the bytes)
    seconds = None
    if to_generate == 0:
        seconds = 0.0
    elif to_generate is not None and rate:
        seconds = to_generate / rate
    return Projection(
        conversations,
        completion,
        estimate.bytes,
        to_generate,
        seconds,
        rate,
        rate_basis if rate else None,
        estimate.basis,
    )
