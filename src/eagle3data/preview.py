"""What the hidden-state stage will need, estimated from the files on disk.

Used by the dry run (``snakemake -n`` prints it) so a user learns the bytes before a
run starts, not when the disk fills. The estimate only reads the prepared prompt
order and the generation journal, both cheap, and gets better as generation goes on:

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import polars as pl

from .budget import Outcome, select_prefix
from .journal import read_journal
from .settings import (
    generation_key,
    generation_settings,
    hidden_size,
    hidden_state_dtype,
    model_fingerprint,
    read_model_config,
    resolve_dtype_name,
)
from .shards import bytes_per_token

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
    requested = hidden_state_dtype(config["hidden_states"], config["model"]["dtype"])
    return bytes_per_token(hidden_size(model_config), resolve_dtype_name(requested, model_config))


def _conversation_tokens(record: Mapping[str, Any], max_seq_len: int) -> int:
    last = record["turns"][-1]
    return min(int(last["prompt_tokens"]) + int(last["completion_tokens"]), max_seq_len)


def estimate_hidden_states(
    config: Mapping[str, Any], dataset: str, results_dir: str | Path = "results"
) -> HiddenStateEstimate:
    results = Path(results_dir)
    ds_cfg = config["datasets"][dataset]
    budget, max_samples = ds_cfg.get("token_budget"), ds_cfg.get("max_samples")
    max_seq_len = int(config["hidden_states"]["max_seq_len"])
    per_token = model_bytes_per_token(config)

    def lower_bound() -> HiddenStateEstimate:
        if budget is None:
            return HiddenStateEstimate(dataset, "unknown", max_samples, None, per_token)
        return HiddenStateEstimate(dataset, "lower bound", None, budget, per_token)

    prompts_file = results / "prompts" / f"{dataset}.parquet"
    if per_token is None or not prompts_file.exists():
        return lower_bound()
    key = generation_key(generation_settings(config), model_fingerprint(config["model"]["path"]))
    journal = results / ".work" / "generate" / dataset / f"{key}.jsonl"
    prompts = pl.read_parquet(prompts_file, columns=["index", "id", "prompt_hash"]).sort("index")
    wanted = dict(zip(prompts["id"].to_list(), prompts["prompt_hash"].to_list(), strict=True))
    records: dict[str, Mapping[str, Any]] = {}
    for rec in read_journal(journal):
        if wanted.get(rec.get("id")) == rec.get("prompt_hash"):
            records.setdefault(rec["id"], rec)
    outcomes = {
        pid: Outcome(0, failed=True)
        if r["status"] == "failed"
        else Outcome(int(r["usage"]["completion_tokens"]))
        for pid, r in records.items()
    }
    order: Sequence[str] = prompts["id"].to_list()
    sel = select_prefix(order, outcomes, token_budget=budget, max_samples=max_samples)
    known = [records[order[pos]] for pos in sel.selected]
    tokens = sum(_conversation_tokens(r, max_seq_len) for r in known)
    if sel.complete:
        return HiddenStateEstimate(dataset, "decided", len(known), tokens, per_token)
    ok = [r for r in records.values() if r["status"] != "failed"]
    if not ok:
        return lower_bound()
    # Extrapolate the undecided rest at the cost of the conversations seen so far.
    per_conversation = sum(_conversation_tokens(r, max_seq_len) for r in ok) / len(ok)
    completion = sum(int(r["usage"]["completion_tokens"]) for r in ok) / len(ok)
    remaining = len(order) - sel.frontier
    more = float(remaining)
    if budget is not None:
        more = min(more, max(budget - sel.tokens, 0) / max(completion, 1.0))
    if max_samples is not None:
        more = min(more, max_samples - len(known))
    return HiddenStateEstimate(
        dataset,
        "extrapolated",
        len(known) + round(more),
        tokens + round(more * per_conversation),
        per_token,
    )


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def preview_lines(config: Mapping[str, Any], results_dir: str | Path = "results") -> list[str]:
    """The dry run's summary: hidden-state bytes per dataset, total, free disk."""
    estimates = [estimate_hidden_states(config, ds, results_dir) for ds in config["datasets"]]
    lines = ["Hidden-state estimate (from the files on disk; see README, 'Dry run'):"]
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
        target = Path(results_dir)
        existing = next(p for p in (target, *target.resolve().parents) if p.exists())
        # Shards already there are replaced by a re-run, so their bytes count as free.
        replaced = sum(f.stat().st_size for f in target.glob("hidden_states/*/shard-*.h5"))
        free = shutil.disk_usage(existing).free + replaced
        total = sum(sizes)
        lines.append(f"  total: {human_bytes(total)}; free on {existing}: {human_bytes(free)}")
        if total > free:
            lines.append("  WARNING: the hidden states will not fit on this disk")
    return lines
