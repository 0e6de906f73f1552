"""The generate stage: one dataset's budget-capped responses, resumed from its journal."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..atomic import atomic_path, write_json, write_jsonl
from ..images import ImageTable, has_images
from ..layout import JOURNAL, Results
from ..prompts.table import iter_prompts
from ..target import check_remote_code
from .driver import ErrorLimits, GenerationJob, Prompt, run_generation, write_outputs
from .engines import build_engine, is_streaming
from .engines.endpoint_slots import slot_root
from .records import summarise
from .settings import GenerationSettings

log = logging.getLogger(__name__)


def generate(
    *,
    dataset: str,
    settings: GenerationSettings,
    token_budget: int | None,
    max_samples: int | None,
    prompts_path: str,
    skipped_path: str,
    out_responses: str,
    out_stats: str,
    out_errors: str,
    out_records: str,
    results: Results | None = None,
    threads: int | None = None,
    images_path: str | None = None,
) -> None:
    """``settings``: what changes the output (the journal's key) and how to run it;
    ``images_path``: the dataset's image table (read only when a prompt has images)."""
    # Before any server is asked: tokenize will need the target's own tokenizer.
    check_remote_code(settings.model_path, settings.trust_remote_code)
    key = settings.key()
    journal = (results or Results()).path(JOURNAL, dataset=dataset, key=key)
    describe_journal(journal, settings.content)
    prompts = [
        Prompt(r["id"], r["prompt_hash"], r["messages"], r.get("tools"))
        for r in iter_prompts(prompts_path)
    ]
    job = GenerationJob(
        dataset=dataset,
        prompts=prompts,
        journal=journal,
        model=settings.model,
        sampling=settings.sampling,
        seed=settings.seed,
        token_budget=token_budget,
        max_samples=max_samples,
        batch_size=settings.batch_size or 1,  # in-process batches only
        progress_interval_s=settings.progress_interval_s,
    )
    streaming = is_streaming(settings.backend)
    # HTTP: each endpoint's concurrency is the run's, shared with the other datasets' jobs.
    slot_dir = slot_root(results) if streaming else None
    with contextlib.ExitStack() as open_files:
        images = None
        if images_path is not None and any(has_images(p.messages) for p in prompts):
            images = open_files.enter_context(ImageTable(images_path))
        result = run_generation(
            job,
            lambda: build_engine(
                settings, threads=threads, label=dataset, slot_dir=slot_dir, images=images
            ),
            streaming=streaming,
            error_limits=ErrorLimits(
                max_consecutive_failures=settings.max_consecutive_failures,
                max_error_rate=settings.max_error_rate,
            )
            if streaming
            else None,
        )
    stats = dict(result.stats)
    stats["skipped_input"] = len(Path(skipped_path).read_text(encoding="utf-8").splitlines())
    stats["settings_key"] = key
    stats["backend"] = settings.backend
    write_outputs(result, Path(out_responses))
    write_jsonl(out_errors, result.failures)
    with atomic_path(out_records) as tmp:
        summarise(result.records).write_parquet(tmp)
    write_json(out_stats, stats)
    log.info(
        "%s: wrote %d responses, %d completion tokens (budget %s, stop: %s); "
        "accounting: %d prompts = %d in output + %d failed + %d beyond limits "
        "(+%d skipped as bad input); waste %d tokens; %d failed over the context",
        dataset,
        stats["in_output"],
        stats["completion_tokens"],
        stats["token_budget"],
        stats["stop_reason"],
        stats["prompts"],
        stats["in_output"],
        stats["failed"],
        stats["beyond_limits"],
        stats["skipped_input"],
        stats["waste_tokens"],
        stats["over_context"],
    )


def describe_journal(journal: Path, settings: Mapping[str, Any]) -> None:
    """Write what a journal was made with next to it; say so when settings changed."""
    info = journal.with_suffix(".settings.json")
    others = sorted(p for p in journal.parent.glob("*.settings.json") if p != info)
    if not journal.exists() and others:
        log.warning(
            "generation settings differ from the %d earlier sidecar(s) in %s: starting a new "
            "sidecar %s (earlier progress is kept there, unused)",
            len(others),
            journal.parent,
            journal.name,
        )
    if not info.exists():
        write_json(info, dict(settings))
