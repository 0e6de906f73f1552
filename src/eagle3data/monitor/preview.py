"""What the hidden-state stage will need, estimated from the files on disk.

Used by the dry run (``snakemake -n`` prints it) so a user learns the bytes before a
run starts, not when the disk fills. The estimate only reads the prepared prompt
order and the generation journal, both cheap, and gets better as generation goes on:

The journal's abandoned records (requests cancelled in flight) decide no prompt: the
prefix is what the outcomes alone give, as a re-run selects it; their decode is waste.

* ``decided``: the journal already decides the budget prefix, so the conversations
  are known and their tokens are the engine's counts of the final turn (prompt +
  completion), capped at ``max_seq_len``; tokenization may differ by a few tokens;
* ``extrapolated``: part of the prefix is known; the rest of the budget is assumed
  to cost what the finished conversations cost per completion token;
* ``lower bound``: nothing generated yet; the completion budget alone (prompts add
  more); no estimate without a token budget.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import polars as pl

from ..errors import JournalCorruptError
from ..generation.records import SUMMARY_SCHEMA
from ..generation.settings import journal_key
from ..hidden_states.settings import CaptureSettings
from ..layout import JOURNAL, PROMPTS, STATUS_CACHE, Results
from ..model_config import hidden_size, read_model_config, resolve_dtype_name
from ..prompts.table import prompt_order
from ..shards import bytes_per_token
from ..units import human_bytes
from .progress import DatasetProgress, dataset_progress, journal_summary
from .stages import responses_current

Basis = Literal["decided", "extrapolated", "lower bound", "unknown"]


@dataclass(frozen=True)
class HiddenStateEstimate:
    dataset: str
    basis: Basis
    conversations: int | None  # None: not known yet
    tokens: int | None
    bytes_per_token: int | None  # None: the model directory does not exist yet

    @property
    def bytes(self) -> int | None:
        if self.tokens is None or self.bytes_per_token is None:
            return None
        return self.tokens * self.bytes_per_token


def model_bytes_per_token(config: Mapping[str, Any]) -> int | None:
    model_path = Path(config["model"]["path"])
    if not (model_path / "config.json").is_file():
        return None
    model_config = read_model_config(model_path)
    capture = CaptureSettings.of_config(config)
    return bytes_per_token(
        hidden_size(model_config),
        resolve_dtype_name(capture.dtype, model_config),
        capture.storage_dtype,
    )


def estimate_hidden_states(
    config: Mapping[str, Any], dataset: str, results: Results | None = None
) -> HiddenStateEstimate:
    per_token = model_bytes_per_token(config)
    # Without the model there is no journal key, and nothing to estimate in bytes.
    progress = generation_progress(config, dataset, results) if per_token is not None else None
    return estimate_from(config, dataset, progress, per_token)


def estimate_from(
    config: Mapping[str, Any],
    dataset: str,
    progress: DatasetProgress | None,
    per_token: int | None,
) -> HiddenStateEstimate:
    """The estimate for a dataset whose progress (None: prompts not prepared) is known."""
    ds_cfg = config["datasets"][dataset]
    budget, max_samples = ds_cfg.get("token_budget"), ds_cfg.get("max_samples")
    if per_token is None or progress is None or progress.basis == "nothing yet":
        if budget is None:
            return HiddenStateEstimate(dataset, "unknown", max_samples, None, per_token)
        return HiddenStateEstimate(dataset, "lower bound", None, budget, per_token)
    return HiddenStateEstimate(
        dataset,
        "decided" if progress.basis == "decided" else "extrapolated",
        progress.expected_conversations,
        progress.expected_tokens,
        per_token,
    )


def generation_progress(
    config: Mapping[str, Any], dataset: str, results: Results | None = None
) -> DatasetProgress | None:
    """The dataset's budget prefix so far, or None before its prompts are prepared."""
    results = results or Results()
    prompts_file = results.path(PROMPTS, dataset=dataset)
    if not prompts_file.exists():
        return None
    ds_cfg = config["datasets"][dataset]
    journal = journal_path(config, dataset, results)
    return dataset_progress(
        *prompt_order(prompts_file),
        pl.DataFrame(schema=SUMMARY_SCHEMA)
        if journal is None
        else journal_summary(journal, results.path(STATUS_CACHE)),
        token_budget=ds_cfg.get("token_budget"),
        max_samples=ds_cfg.get("max_samples"),
        max_seq_len=int(config["hidden_states"]["max_seq_len"]),
    )


def limits_text(ds_cfg: Mapping[str, Any]) -> str:
    """A dataset's limits in words, e.g. ``800 completion tokens and 16 conversations``."""
    budget, max_samples = ds_cfg.get("token_budget"), ds_cfg.get("max_samples")
    return (
        " and ".join(
            text
            for text in (
                None if budget is None else f"{budget} completion tokens",
                None if max_samples is None else f"{max_samples} conversations",
            )
            if text
        )
        or "no limit (every prompt)"
    )


def cancelled_note(tokens: int, estimated: int) -> str:
    """After a waste: the part of it requests cancelled in flight decoded, e.g. `` (119 of
    them cancelled in flight, 40 estimated)``; nothing when none was."""
    if not tokens:
        return ""
    return f" ({tokens} of them cancelled in flight" + (
        f", {estimated} estimated)" if estimated else ")"
    )


def generation_line(
    config: Mapping[str, Any],
    dataset: str,
    progress: DatasetProgress | None,
    results: Results | None = None,
) -> str:
    """What generation still has to do for one dataset, in tokens and conversations."""
    ds_cfg = config["datasets"][dataset]
    limits = limits_text(ds_cfg)
    if progress is None or progress.basis == "nothing yet":
        return f"  {dataset}: nothing generated yet; up to {limits}"
    done = (
        f"{progress.completion_tokens} completion tokens in {progress.conversations} conversations"
    )
    if progress.basis == "decided":
        waste = progress.generated_tokens - progress.completion_tokens
        cancelled = cancelled_note(progress.abandoned_tokens, progress.abandoned_tokens_estimated)
        line = f"  {dataset}: done: {done} (limits: {limits}); waste {waste} tokens{cancelled}"
        if not responses_current(results or Results(), dataset, ds_cfg):
            # A changed limit lists a generate job: say it generates nothing.
            line += "; nothing to generate: its generate job only writes the output"
        return line
    more_convs = progress.expected_conversations - progress.conversations
    more = progress.expected_completion_tokens - progress.completion_tokens
    return (
        f"  {dataset}: {done}; about {more} completion tokens (~{more_convs} conversations) "
        f"to go (limits: {limits})"
    )


def journal_path(config: Mapping[str, Any], dataset: str, results: Results) -> Path | None:
    """The journal the current generation settings write (None until the model directory
    exists: its files are part of the journal's key)."""
    if not (Path(config["model"]["path"]) / "config.json").is_file():
        return None
    return results.path(JOURNAL, dataset=dataset, key=journal_key(config))


def preview_lines(config: Mapping[str, Any], results: Results | None = None) -> list[str]:
    """The dry run's summary: generation still to do, then hidden-state bytes per
    dataset, their total and the free disk."""
    results = results or Results()
    progress: dict[str, DatasetProgress | None] = {}
    unreadable: dict[str, str] = {}
    for ds in config["datasets"]:
        try:
            progress[ds] = generation_progress(config, ds, results)
        except JournalCorruptError as exc:  # the generate job stops on it with this line
            progress[ds], unreadable[ds] = None, str(exc)
    lines = ["Generation (from the journals; see docs/reference/status.md, 'Dry run'):"]
    lines += [
        f"  {ds}: {unreadable[ds]}"
        if ds in unreadable
        else generation_line(config, ds, progress[ds], results)
        for ds in config["datasets"]
    ]
    per_token = model_bytes_per_token(config)
    estimates = [estimate_from(config, ds, progress[ds], per_token) for ds in config["datasets"]]
    lines.append("Hidden-state estimate (from the files on disk):")
    for e in estimates:
        if e.bytes_per_token is None:
            lines.append(f"  {e.dataset}: unknown until the model directory exists")
            continue
        if e.tokens is None:
            what = "unknown until something is generated (no token_budget)"
        else:
            size = human_bytes(e.tokens * e.bytes_per_token)
            convs = "" if e.conversations is None else f"{e.conversations} conversations, "
            bound = "at least " if e.basis == "lower bound" else "about "
            what = f"{convs}{bound}{e.tokens} tokens x {e.bytes_per_token} B = {bound}{size}"
        lines.append(f"  {e.dataset}: {what} ({e.basis})")
    sizes = [e.bytes for e in estimates if e.bytes is not None]
    if sizes:
        target = results.root
        existing = next(p for p in (target, *target.resolve().parents) if p.exists())
        # Shards already there are replaced by a re-run, so their bytes count as free.
        replaced = sum(f.stat().st_size for f in results.shard_files("*"))
        free = shutil.disk_usage(existing).free + replaced
        total = sum(sizes)
        lines.append(f"  total: {human_bytes(total)}; free on {existing}: {human_bytes(free)}")
        if total > free:
            lines.append("  WARNING: the hidden states will not fit on this disk")
    return lines
