"""Where every dataset stands, from the files on disk: the rows ``eagle3data-status`` prints.

Safe while a run is in progress: it only reads append-only journals, their run files
and finished outputs (and keeps a small summary cache of each journal under
results/.work/status). Per dataset:

* ``state``: ``running`` while a job works on it (one of its generation journals or one
  of its jobs has a live writer: :mod:`..liveness`; or a live process of this host is
  writing one of its shards), else ``done`` once every stage is, else ``stopped``;
* ``stage``: the first stage a run would still do (:mod:`.stages`);
* the budget prefix decided so far, why the prefix ends (``stop``), the waste (every
  token generated and not in the prefix), with the part of it that requests cancelled in
  flight decoded (the journal's abandoned records: ``645 (119 cancelled)``);
* the rate and ETA of the running job only (:mod:`.projection`);
* the projection: where it ends under the current limits, and its basis;
* shards and hidden-state bytes, against the same estimate the dry run prints;
* once tokenized, how many turns were trained on the engine's token ids and how many of
  those the chat template re-renders identically (``ids=render``: the tokenize stats);
* once validated, the target's agreement with its tokens over the control (the validate
  job's check, :mod:`..hidden_states.agreement`);
* what the last generate job's stats say about the servers' edges (:func:`notes_lines`):
  prompts over the context, endpoints that refused ``return_token_ids``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..atomic import live_temporaries
from ..hidden_states import fingerprint
from ..layout import (
    JOURNAL_DIR,
    MANIFEST,
    RESPONSE_STATS,
    SHARD_DIR,
    SHARD_PLAN,
    SKIPPED_PROMPTS,
    TOKENIZE_STATS,
    TOKENIZED,
    Results,
)
from ..liveness import read_run, run_file, runs_in
from ..units import duration, human_bytes, human_count
from .preview import estimate_from, generation_progress, journal_path, limits_text
from .progress import DatasetProgress, file_lines
from .projection import current_rate, last_run_rate, project
from .stages import STAGES, dataset_stage, fresh


@dataclass(frozen=True)
class DatasetStatus:
    dataset: str
    state: str  # running, stopped, done
    stage: str  # the first stage not done (stages.STAGES)
    stop_reason: str | None  # token_budget, max_samples or exhausted, once the prefix is decided
    prompts: int | None
    skipped_input: int
    failed: int
    conversations_done: int
    conversations_planned: int | None  # the projected end; exact once the prefix is decided
    completion_tokens: int
    token_budget: int | None
    max_samples: int | None
    budget_used: float | None  # completion_tokens / token_budget
    generated_tokens: int  # everything journaled, used or not
    waste_tokens: int  # generated_tokens - completion_tokens
    # Conversations cancelled in flight (abandoned records, the generate stats' keys of the
    # same names): how many, what the engine had decoded for them (part of the waste) and
    # the part of that estimated (no server said).
    abandoned_requests: int
    abandoned_tokens: int
    abandoned_tokens_estimated: int
    tokens_per_s: float | None  # the running job's; None when stopped or idle
    eta_s: float | None  # of the running job
    projected_completion_tokens: int | None
    tokens_to_generate: int | None
    projected_s: float | None  # to generate them at projection_rate
    projection_rate: float | None
    projection_rate_basis: str | None  # "this run" or "last run"
    projection_basis: str  # decided, extrapolated, lower bound, unknown
    shards_done: int
    shards_planned: int | None  # from a plan that is up to date
    bytes_on_disk: int
    bytes_estimated: int | None  # the projection's hidden-state bytes (the dry run's estimate)
    estimate_basis: str
    run: dict[str, Any] | None  # the journal's latest writer: host, pid, started_at, ended_at
    # The validate job's agreement check (manifest.json), once validated; None before.
    agreement: dict[str, Any] | None = None
    # The tokenize stats' ``token_ids`` section, once tokenized; None before (or in stats
    # written before ids were kept).
    token_ids: dict[str, Any] | None = None
    # The last generate job's counters of the servers' edges (:data:`NOTE_KEYS`), once it
    # wrote its stats; None before.
    generation_notes: dict[str, int] | None = None
    # What captured the validated shards (the manifest's capture fingerprint, in words);
    # None before validation.
    capture: str | None = None


@dataclass(frozen=True)
class DatasetSnapshot:
    status: DatasetStatus
    progress: DatasetProgress | None  # its journal records too (for the pictures)


def _working(results: Results, dataset: str, now: float) -> bool:
    """Whether a job works on the dataset now: a live writer holds one of its journals
    (also one of other generation settings), one of its jobs is alive (the run file
    beside its log), or a live process of this host writes one of its shards."""
    runs = runs_in(results.path(JOURNAL_DIR, dataset=dataset))
    runs += [run for log in results.job_logs(dataset) if (run := read_run(log))]
    return any(run.running(now) for run in runs) or bool(
        live_temporaries(results.path(SHARD_DIR, dataset=dataset))
    )


def dataset_snapshot(
    config: Mapping[str, Any],
    dataset: str,
    results: Results,
    per_token: int | None,
    now: float | None = None,
) -> DatasetSnapshot:
    now = time.time() if now is None else now
    ds_cfg = config["datasets"][dataset]
    progress = generation_progress(config, dataset, results)
    journal = journal_path(config, dataset, results)
    run = None if journal is None or not run_file(journal).exists() else read_run(journal)
    stage = dataset_stage(results, dataset, config)
    state = (
        "running" if _working(results, dataset, now) else "done" if stage == "done" else "stopped"
    )

    rate = rate_basis = None
    if progress is not None and run is not None and not progress.selection.complete:
        if run.running(now):
            rate, rate_basis = current_rate(progress.journal, run, now), "this run"
        else:
            rate, rate_basis = last_run_rate(progress.journal, run), "last run"
    estimate = estimate_from(config, dataset, progress, per_token)
    projection = project(ds_cfg, progress, estimate, rate, rate_basis)
    this_run = rate_basis == "this run"

    plan_file = results.path(SHARD_PLAN, dataset=dataset)
    shards_planned = None
    if STAGES.index(stage) >= STAGES.index("hidden_states") and fresh(
        [plan_file], [results.path(TOKENIZED, dataset=dataset)]
    ):
        shards_planned = len(json.loads(plan_file.read_text())["shards"])
    shard_files = results.shard_files(dataset)

    budget = ds_cfg.get("token_budget")
    done = completion = generated = failed = 0
    abandoned = (0, 0, 0)
    if progress is not None:
        done, completion = progress.conversations, progress.completion_tokens
        generated, failed = progress.generated_tokens, progress.failed
        abandoned = (
            progress.abandoned_requests,
            progress.abandoned_tokens,
            progress.abandoned_tokens_estimated,
        )
    decided = progress is not None and progress.selection.complete
    status = DatasetStatus(
        dataset=dataset,
        state=state,
        stage=stage,
        stop_reason=progress.selection.stop_reason if decided and progress else None,
        prompts=None if progress is None else progress.prompts,
        skipped_input=file_lines(results.path(SKIPPED_PROMPTS, dataset=dataset)),
        failed=failed,
        conversations_done=done,
        conversations_planned=projection.conversations,
        completion_tokens=completion,
        token_budget=budget,
        max_samples=ds_cfg.get("max_samples"),
        budget_used=None if not budget else completion / budget,
        generated_tokens=generated,
        waste_tokens=generated - completion,
        abandoned_requests=abandoned[0],
        abandoned_tokens=abandoned[1],
        abandoned_tokens_estimated=abandoned[2],
        tokens_per_s=rate if this_run else None,
        eta_s=projection.seconds if this_run else None,
        projected_completion_tokens=projection.completion_tokens,
        tokens_to_generate=projection.to_generate,
        projected_s=projection.seconds,
        projection_rate=projection.rate,
        projection_rate_basis=projection.rate_basis,
        projection_basis=projection.basis,
        shards_done=len(shard_files),
        shards_planned=shards_planned,
        bytes_on_disk=sum(f.stat().st_size for f in shard_files),
        bytes_estimated=projection.hidden_state_bytes,
        estimate_basis=estimate.basis,
        run=None if run is None else {k: v for k, v in asdict(run).items() if k != "heartbeat_at"},
        agreement=_agreement(results, dataset),
        token_ids=_token_ids(results, dataset),
        generation_notes=_generation_notes(results, dataset),
        capture=_capture(results, dataset),
    )
    return DatasetSnapshot(status, progress)


def _token_ids(results: Results, dataset: str) -> dict[str, Any] | None:
    stats = results.path(TOKENIZE_STATS, dataset=dataset)
    if not stats.is_file():
        return None
    summary = json.loads(stats.read_text()).get("token_ids")
    return None if summary is None else {k: v for k, v in summary.items() if k != "differences"}


# The generate stats' counters the status reports (driver._assemble writes them).
NOTE_KEYS = ("over_context", "token_ids_fallbacks", "capture_files_left")


def _generation_notes(results: Results, dataset: str) -> dict[str, int] | None:
    stats = results.path(RESPONSE_STATS, dataset=dataset)
    if not stats.is_file():
        return None
    written = json.loads(stats.read_text())
    return {k: int(written[k]) for k in NOTE_KEYS if k in written}


def notes_lines(rows: Sequence[DatasetStatus]) -> list[str]:
    """One line per dataset whose last generate job met a server's edge; none otherwise."""
    lines = []
    for r in rows:
        notes = r.generation_notes or {}
        said = []
        if notes.get("over_context"):
            said.append(
                f"{notes['over_context']} prompt(s) over the model's context (in its "
                "errors.jsonl, kind over_context)"
            )
        if notes.get("token_ids_fallbacks"):
            said.append(
                f"{notes['token_ids_fallbacks']} endpoint(s) refused return_token_ids or sent "
                "ids in an unknown shape: asked in text, their turns re-rendered at tokenize"
            )
        if notes.get("capture_files_left"):
            said.append(
                f"{notes['capture_files_left']} hidden-state file(s) a capture server wrote "
                "for generation requests could not be deleted (see the job log)"
            )
        if said:
            lines.append(f"  {r.dataset}: " + "; ".join(said))
    return ["Servers (the last generate job):", *lines] if lines else []


def token_ids_cell(summary: Mapping[str, Any] | None) -> str:
    """``118/120``: of the turns trained on the engine's ids, those the chat template
    re-renders identically; ``none``: no turn had ids (re-rendered); ``-`` before."""
    if summary is None:
        return "-"
    if not summary["turns_from_engine_ids"]:
        return "none"
    return f"{summary['identical_to_rerender']}/{summary['turns_from_engine_ids']}"


def _agreement(results: Results, dataset: str) -> dict[str, Any] | None:
    """The manifest's agreement totals (without the per-shard list), or None when the
    dataset is not validated; ``{"enabled": False}`` when the check was off."""
    manifest = results.path(MANIFEST, dataset=dataset)
    if not manifest.is_file():
        return None
    check = json.loads(manifest.read_text()).get("agreement")
    if check is None:
        return {"enabled": False}
    return {k: v for k, v in check.items() if k not in ("shards", "settings")}


def _capture(results: Results, dataset: str) -> str | None:
    """The validated shards' capture fingerprint in words; None before validation."""
    manifest = results.path(MANIFEST, dataset=dataset)
    if not manifest.is_file():
        return None
    written = json.loads(manifest.read_text())
    captured = written.get("capture_fingerprint")
    return fingerprint.describe(captured or fingerprint.fingerprint_of(written.get("attrs") or {}))


def capture_lines(rows: Sequence[DatasetStatus]) -> list[str]:
    """What captured each validated dataset's shards, one line each; none before."""
    lines = [f"  {r.dataset}: {r.capture}" for r in rows if r.capture is not None]
    return ["Captured with (validated shards):", *lines] if lines else []


def agreement_cell(check: Mapping[str, Any] | None) -> str:
    """``0.97/0.01``: agreement over the control (greedy); ``lp -1.6/-9.7``: mean
    log-probabilities (sampled); ``off``; ``-`` before validation."""
    if check is None:
        return "-"
    if check.get("enabled") is False:
        return "off"
    if not check.get("positions"):
        return "n/a"
    if check["greedy"]:
        return f"{check['agreement']:.2f}/{check['control_agreement']:.2f}"
    return f"lp {check['mean_logprob']:.1f}/{check['control_mean_logprob']:.1f}"


# --- as printed ------------------------------------------------------------------------

# How sure a projected number is, by basis. Before anything is generated ("lower
# bound"), the budget caps the completion tokens, while the hidden states hold the
# prompts too: at most so many tokens, at least so many bytes.
_ABOUT = {"decided": "", "extrapolated": "~", "lower bound": "<=", "unknown": ""}
_ABOUT_BYTES = {**_ABOUT, "lower bound": ">="}


def _about(n: int | None, basis: str) -> str:
    return "?" if n is None else f"{_ABOUT.get(basis, '')}{human_count(n)}"


def waste_cell(r: DatasetStatus) -> str:
    """The waste, and the part of it requests cancelled in flight decoded: ``645 (119
    cancelled)``; ``~``: partly estimated (no server said)."""
    if not r.abandoned_tokens:
        return str(r.waste_tokens)
    about = "~" if r.abandoned_tokens_estimated else ""
    return f"{r.waste_tokens} ({about}{r.abandoned_tokens} cancelled)"


def format_table(rows: Sequence[DatasetStatus]) -> str:
    header = (
        "dataset",
        "state",
        "stage",
        "conversations",
        "completion tokens / budget",
        "projected",
        "stop",
        "waste",
        "tok/s",
        "ETA",
        "failed",
        "skipped",
        "shards",
        "hidden states on disk / est.",
        "ids=render",
        "agrees/ctrl",
    )
    lines = [header]
    for r in rows:
        planned = "?" if r.conversations_planned is None else r.conversations_planned
        convs = f"{r.conversations_done}/{planned}"
        if r.token_budget is None:
            tokens = f"{r.completion_tokens}/-"
        else:
            tokens = f"{r.completion_tokens}/{r.token_budget} ({100 * (r.budget_used or 0):.0f}%)"
        est = "?"
        if r.bytes_estimated is not None:
            est = _ABOUT_BYTES.get(r.estimate_basis, "") + human_bytes(r.bytes_estimated)
        lines.append(
            (
                r.dataset,
                r.state,
                r.stage,
                convs,
                tokens,
                _about(r.projected_completion_tokens, r.projection_basis),
                r.stop_reason or "-",
                waste_cell(r),
                "-" if r.tokens_per_s is None else f"{r.tokens_per_s:.0f}",
                duration(r.eta_s),
                str(r.failed),
                str(r.skipped_input),
                f"{r.shards_done}/{r.shards_planned if r.shards_planned is not None else '?'}",
                f"{human_bytes(r.bytes_on_disk)} / {est}",
                token_ids_cell(r.token_ids),
                agreement_cell(r.agreement),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def end_text(r: DatasetStatus) -> str:
    """Where the dataset ends: conversations, completion tokens, hidden-state bytes."""
    size = "?" if r.bytes_estimated is None else human_bytes(r.bytes_estimated)
    basis = r.projection_basis
    return (
        f"{_about(r.conversations_planned, basis)} conversations, "
        f"{_about(r.projected_completion_tokens, basis)} completion tokens, "
        f"{_ABOUT_BYTES.get(basis, '')}{size} of hidden states ({basis})"
    )


def to_go_text(r: DatasetStatus) -> str:
    """What generation still does, and how long that takes at which rate."""
    if r.tokens_to_generate == 0:
        return "nothing to generate"
    if r.tokens_to_generate is None:
        return "still to generate: unknown until something is generated"
    more = f"{_about(r.tokens_to_generate, r.projection_basis)} completion tokens to go"
    if r.projected_s is None or r.projection_rate is None:
        return f"{more} (no rate: {'idle' if r.state == 'running' else 'not running'})"
    return (
        f"{more}: {duration(r.projected_s)} at {r.projection_rate:.0f} tok/s "
        f"({r.projection_rate_basis})"
    )


def projection_lines(config: Mapping[str, Any], rows: Sequence[DatasetStatus]) -> list[str]:
    lines = ["Projection (where each dataset ends under its current limits):"]
    for r in rows:
        limits = limits_text(config["datasets"][r.dataset])
        if r.token_budget is None and r.max_samples is not None:
            limits += "; no token_budget"
        lines.append(f"  {r.dataset}: {end_text(r)}; {to_go_text(r)} (limits: {limits})")
    return lines
