"""Does a draft trained on our shards beat a control? EAGLE-3 on CPU with speculators' own code.

The model and the loss are vLLM speculators' own (``Eagle3DraftModel`` with sdpa attention,
its eager KL loss and its own ``shift_batch`` alignment); only the training loop is ours,
because its ``Trainer`` moves the model to an accelerator unconditionally. Four drafts share
the init seed and the held-out conversations:

- ``trained``: trained on the shards as they are;
- ``aux_shuffled``: trained on the same tokens, loss masks and teacher (final state) with each
  position's aux states replaced by another position's (:func:`shuffle_aux_states`, seeded by
  the training seed). The draft reads only the aux states and the tokens; the final state only
  makes the teacher. This draft can learn token statistics and nothing the aux states carry
  about their position: beating it is what shows the aux states carry the signal;
- ``shifted``: trained on the same data with every hidden state (aux and final) moved one
  position later than its token (row t holds the states of row t-1): the broken link the
  validate stage's agreement check catches. Its teacher moves too (one position late), so it
  shows the check sees that misalignment, not that the aux states carry the signal;
- ``untrained``: the init, never trained (the floor: the loop trains at all).

The criterion (:func:`criterion`): for every control and metric, the trained draft's mean over
seeds beats the control's by more than the larger seed-to-seed spread (max - min) of the two,
and every trained seed beats every control seed.

Metrics (:func:`chain_metrics`), on conversations held out by a seeded split by conversation
(:func:`conversation_keys`, :func:`split_conversations`): every sample of one conversation,
and the same first prompt in any dataset, lands on one side. The draft vocabulary is re-chosen
from the training side's supervised tokens (:func:`training_vocab`).

With speculators' alignment, position t of a conversation feeds the draft the target's aux
states g_t and token x_{t+1}; draft step k (k = 1..K) proposes the token x_{t+1+k}.
Verification is greedy against the target's own tokens: the target produced the response
tokens (the demo generates greedily), so the draft's step-k token is accepted when it and
every earlier step's token equal the tokens the target produced there, and each of those
tokens is supervised (``loss_mask`` 1: the target produced it; a prompt token or the end of
the conversation ends the chain). Start positions are those whose first proposed token is
supervised.

- ``step1_agreement``: the fraction of start positions whose step-1 token is accepted;
- ``acceptance_length``: E[number of consecutive accepted draft tokens out of K] over start
  positions (0..K; the bonus token the target adds on verification is not counted).

Steps 2..K feed the draft its own previous hidden output (as EAGLE-3 test-time training
does) and, as speculators' forward does, the data's token at that position; on an accepted
prefix that token is the draft's own prediction, so the accepted count is exactly what
inference feeding the draft its own tokens would accept.

The final state: speculators computes its teacher as ``lm_head(verifier_norm(last))`` from the
PRE-norm state, which shards extracted with ``final_state: pre_norm`` hold. From post-norm
shards: ``post / norm_weight`` is the pre-norm state up to a scale per token, and the norm's
epsilon says which (:meth:`~eagle3data.hidden_states.final_state.PlainRmsNorm.prenorm_of`),
so the verifier norm maps it back onto ``post``.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import DraftCheckError
from ..hidden_states.final_state import final_state_of
from .draft_data import (
    Sample,
    conversation_keys,
    load_samples,
    shift_states,
    shuffle_aux_states,
    speculators_row,
    split_conversations,
    training_vocab,
)
from .draft_model import (
    DraftCheckSettings,
    build_draft,
    chain_metrics,
    evaluate_draft,
    summarize,
    train_draft,
    verifier_norm,
)

log = logging.getLogger(__name__)
__all__ = [
    "CONTROLS",
    "DraftCheckSettings",
    "Sample",
    "chain_metrics",
    "conversation_keys",
    "criterion",
    "load_samples",
    "run_draft_check",
    "shift_states",
    "shuffle_aux_states",
    "split_conversations",
    "summarize",
    "training_vocab",
]
VARIANTS = ("trained", "aux_shuffled", "shifted", "untrained")
CONTROLS = ("aux_shuffled", "shifted", "untrained")
METRICS = ("step1_agreement", "acceptance_length")


@dataclass
class VariantResult:
    seed: int
    variant: str
    metrics: dict[str, float]
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0


def run_draft_check(
    samples: Sequence[Sample],
    model_dir: Path,
    vocab: dict[str, torch.Tensor],
    layer_ids: Sequence[int],
    settings: DraftCheckSettings,
    variants: Iterable[str] = VARIANTS,
    *,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Train and measure each variant for each seed; the summary (see :func:`margins` and
    :func:`criterion`).

    ``vocab`` is the run's draft vocabulary: the check keeps its size and target vocabulary and
    re-chooses its ids from the training side (:func:`training_vocab`), so that no token only
    the held-out conversations produce is in it.
    """
    variants = tuple(variants)
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}; known: {VARIANTS}")
    norm = verifier_norm(model_dir, trust_remote_code=trust_remote_code)
    keys = conversation_keys(samples)
    train_idx, held_idx = split_conversations(keys, settings.heldout_fraction, settings.split_seed)
    train_samples = [samples[i] for i in train_idx]
    vocab = training_vocab(train_samples, int(vocab["d2t"].numel()), int(vocab["t2d"].numel()))
    train_rows = [speculators_row(s, norm) for s in train_samples]
    held_rows = [speculators_row(samples[i], norm) for i in held_idx]

    def control_rows(variant: str, seed: int) -> list[dict[str, torch.Tensor]]:
        if variant == "aux_shuffled":
            changed = shuffle_aux_states(train_samples, seed)
        else:
            changed = [shift_states(s) for s in train_samples]
        return [speculators_row(s, norm) for s in changed]

    results: list[VariantResult] = []
    for seed in settings.seeds:
        # One init per seed, shared by the variants (and built once: loading the target's
        # embeddings takes seconds).
        init = build_draft(
            model_dir,
            vocab,
            layer_ids,
            num_layers=settings.num_layers,
            ttt_steps=settings.ttt_steps,
            seed=seed,
            fc_norm=settings.fc_norm,
            trust_remote_code=trust_remote_code,
        )
        for variant in variants:
            start = time.monotonic()
            model = copy.deepcopy(init)
            losses: list[float] = []
            if variant != "untrained":
                rows = train_rows if variant == "trained" else control_rows(variant, seed)
                losses = train_draft(model, rows, settings, seed)
            metrics = evaluate_draft(model, held_rows, settings.ttt_steps)
            result = VariantResult(seed, variant, metrics, losses, time.monotonic() - start)
            log.info(
                "seed %d %-12s step1 %.4f  acceptance %.4f / %d  (%.0f s)",
                seed,
                variant,
                metrics["step1_agreement"],
                metrics["acceptance_length"],
                settings.ttt_steps,
                result.seconds,
            )
            results.append(result)
    summary: dict[str, Any] = {
        "settings": {**asdict(settings), "seeds": list(settings.seeds)},
        "conversations": {
            "train": len({keys[i] for i in train_idx}),
            "heldout": len({keys[i] for i in held_idx}),
        },
        "samples": {"train": len(train_idx), "heldout": len(held_idx)},
        "heldout_ids": [samples[i].id for i in held_idx],
        "train_tokens": int(sum(int(r["input_ids"].shape[0]) for r in train_rows)),
        "draft_vocab_size": int(vocab["d2t"].numel()),
        "runs": [asdict(r) for r in results],
    }
    summary["aggregate"] = aggregate(results)
    summary["margins"] = margins(results)
    summary["criterion"] = criterion(summary["margins"])
    return summary


def aggregate(results: Sequence[VariantResult]) -> dict[str, dict[str, dict[str, float]]]:
    """Per variant and metric: mean, sample standard deviation, min and max over seeds."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for variant in dict.fromkeys(r.variant for r in results):
        runs = [r for r in results if r.variant == variant]
        out[variant] = {}
        for metric in ("step1_agreement", "acceptance_length"):
            values = [r.metrics[metric] for r in runs]
            out[variant][metric] = {
                "mean": statistics.fmean(values),
                "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                "min": min(values),
                "max": max(values),
            }
    return out


def margins(results: Sequence[VariantResult]) -> dict[str, dict[str, float]]:
    """For each control and metric: ``margin``, the mean over seeds of ``trained`` minus the
    control's; ``worst_margin``, min over seeds of ``trained`` minus max over seeds of the control
    (positive: every trained seed beats every control seed); and the seed-to-seed spreads
    (max - min): ``trained_spread``, ``control_spread`` and the larger, ``spread``."""
    out: dict[str, dict[str, float]] = {}
    trained = [r for r in results if r.variant == "trained"]
    for control in CONTROLS:
        runs = [r for r in results if r.variant == control]
        if not trained or not runs:
            continue
        for metric in ("step1_agreement", "acceptance_length"):
            t = [r.metrics[metric] for r in trained]
            c = [r.metrics[metric] for r in runs]
            out[f"{control}.{metric}"] = {
                "margin": statistics.fmean(t) - statistics.fmean(c),
                "worst_margin": min(t) - max(c),
                "spread": max(max(t) - min(t), max(c) - min(c)),
                "trained_spread": max(t) - min(t),
                "control_spread": max(c) - min(c),
            }
    return out


def criterion(found_margins: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Whether the trained draft beats each control of :func:`margins`: on every metric, its mean
    beats the control's by more than the larger seed-to-seed spread, and its worst seed beats the
    control's best seed.

    One seed measures no spread, so it cannot pass. Returns ``rule`` (the criterion in words),
    ``controls`` (control: holds), ``passed`` (all hold) and ``reason`` (why not, or "")."""
    rule = (
        "for every control and metric, mean over seeds of trained minus the control's > the "
        "larger seed-to-seed spread (max - min) of the two, and min over seeds of trained > "
        "max over seeds of the control"
    )
    by_control: dict[str, bool] = {}
    for key, m in found_margins.items():
        control = key.split(".")[0]
        by_control[control] = by_control.get(control, True) and (
            m["margin"] > m["spread"] and m["worst_margin"] > 0
        )
    # A spread of exactly 0 on both sides: one seed (or seeds that agree to the last digit).
    no_spread = bool(found_margins) and all(
        m["trained_spread"] == 0 and m["control_spread"] == 0 for m in found_margins.values()
    )
    failed = [c for c, holds in by_control.items() if not holds]
    if not by_control:
        reason = "no control was run"
    elif no_spread:
        reason = "no seed-to-seed spread measured: run at least 2 seeds"
    elif failed:
        reason = "not beaten by more than the seed spread, or not by every seed: " + ", ".join(
            failed
        )
    else:
        reason = ""
    return {"rule": rule, "controls": by_control, "passed": not reason, "reason": reason}


def write_summary(summary: dict[str, Any], path: Path) -> None:
    """The summary as JSON, written aside and renamed into place."""
    from eagle3data.atomic import write_json

    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, summary)


# The config key of the memory bound (``draft_check`` block) and its default.
MEMORY_LIMIT_KEY = "memory_limit_gb"
DEFAULT_MEMORY_LIMIT_GB = 16.0
# Float32 copies of every state the check holds at its peak: the states as loaded, the
# training and held-out rows (a pre-norm copy of the final state) and the controls' copies
# of the training states (the aux shuffle concatenates and permutes them). Measured: peak
# RSS of that preparation 3.5 times one float32 copy (50k tokens, hidden 576).
RESIDENT_COPIES = 4
_FLOAT32_BYTES = 4
# What the check imports of speculators (its model, data alignment and loss).
_SPECULATORS_MODULES = (
    "speculators.models.eagle3",
    "speculators.models.eagle3.data",
    "speculators.models.eagle3.model_definitions",
    "speculators.losses",
)


@dataclass(frozen=True)
class ShardPlan:
    """What the validated shards' manifests say, read before any state is loaded."""

    layer_ids: list[int]
    samples: int
    tokens: int
    hidden_size: int

    @property
    def states_per_token(self) -> int:
        """The aux layers and the final state, hidden_size each."""
        return len(self.layer_ids) + 1

    @property
    def memory_bytes(self) -> int:
        """The memory the check's states take (:data:`RESIDENT_COPIES` float32 copies)."""
        per_token = self.states_per_token * self.hidden_size * _FLOAT32_BYTES
        return self.tokens * per_token * RESIDENT_COPIES


def read_shard_plan(shard_dirs: Sequence[str | Path]) -> ShardPlan:
    """The aux layers, conversations, tokens and hidden size of the shard directories'
    manifests; one line when they cannot be one check's data."""
    import json

    layer_ids: list[int] | None = None
    hidden: int | None = None
    samples = tokens = 0
    for directory in shard_dirs:
        path = Path(directory) / "manifest.json"
        manifest = json.loads(path.read_text(encoding="utf-8"))
        attrs = manifest.get("attrs") or {}
        if not attrs:  # an empty dataset (e.g. token_budget 0) has no attrs and no states
            continue
        final_state_of(attrs, path)
        ids = [int(k) for k in attrs["aux_hidden_states_indices"]]
        if layer_ids is not None and ids != layer_ids:
            raise DraftCheckError(f"{path}: aux layers {ids} differ from {layer_ids}")
        if hidden is not None and int(attrs["hidden_size"]) != hidden:
            raise DraftCheckError(
                f"{path}: hidden size {attrs['hidden_size']} differs from {hidden}"
            )
        layer_ids, hidden = ids, int(attrs["hidden_size"])
        samples += int(manifest["num_samples"])
        tokens += int(manifest["num_tokens"])
    if layer_ids is None or hidden is None or samples < 2:
        raise DraftCheckError(
            f"the draft check needs at least 2 samples to hold some out; the shards of "
            f"{len(shard_dirs)} dataset(s) hold {samples}"
        )
    return ShardPlan(layer_ids, samples, tokens, hidden)


def memory_needed(shard_dirs: Sequence[str | Path]) -> int:
    """Bytes of the states the check would hold for these shards (:class:`ShardPlan`)."""
    return read_shard_plan(shard_dirs).memory_bytes


def check_memory(plan: ShardPlan, limit_gb: float) -> None:
    """Refuse, in one line, a check whose states would take more than ``limit_gb``: it holds
    every state in memory (float32), so a run over the machine's memory would only be killed."""
    if plan.memory_bytes > limit_gb * 1e9:
        raise DraftCheckError(
            f"the draft check would hold {plan.memory_bytes / 1e9:.1f} GB of states ("
            f"{plan.tokens} tokens x {plan.states_per_token} states x hidden {plan.hidden_size} x "
            f"{_FLOAT32_BYTES} bytes x {RESIDENT_COPIES} copies), over "
            f"draft_check.{MEMORY_LIMIT_KEY} ({limit_gb:g} GB); raise it on a machine with "
            f"that memory, or check fewer or smaller datasets"
        )


def require_speculators() -> None:
    """One line saying how to install speculators when it does not import."""
    import importlib

    for name in _SPECULATORS_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise DraftCheckError(
                f"the draft check trains vLLM speculators' own Eagle3 draft, which does not "
                f"import ({exc}); install it with `pip install --no-deps speculators==0.9.0 "
                f"hs-connectors==0.9.0` (README, the test command)"
            ) from None


def _settings_of(section: dict[str, Any]) -> tuple[DraftCheckSettings, float]:
    """The check's settings and memory bound from the config's ``draft_check`` block."""
    try:
        check = DraftCheckSettings.from_config(section)
        limit = float(section.get(MEMORY_LIMIT_KEY, DEFAULT_MEMORY_LIMIT_GB))
    except (TypeError, ValueError) as exc:
        raise DraftCheckError(f"draft_check settings: {exc}") from None
    return check, limit


def draft_check(
    *,
    shard_dirs: Sequence[str],
    draft_vocab: str,
    model_dir: str,
    out: str,
    settings: dict[str, Any],
    num_threads: int = 1,
    trust_remote_code: bool = False,
) -> None:
    """Stage function: the check over validated shard directories, ``out`` (summary JSON).

    Every refusal (settings, speculators missing, shards that cannot be one check's data,
    states over the memory bound, a final norm speculators' teacher gets wrong) comes in one
    line before any state is loaded."""
    check, memory_limit_gb = _settings_of(settings)
    require_speculators()
    plan = read_shard_plan(shard_dirs)
    check_memory(plan, memory_limit_gb)
    verifier_norm(model_dir, trust_remote_code=trust_remote_code)
    torch.set_num_threads(max(1, num_threads))
    vocab = torch.load(draft_vocab, map_location="cpu", weights_only=True)
    samples = load_samples(shard_dirs)
    log.info(
        "%d conversations, %d tokens, aux layers %s (%.2f GB of states, bound %g GB)",
        len(samples),
        sum(len(s.input_ids) for s in samples),
        plan.layer_ids,
        plan.memory_bytes / 1e9,
        memory_limit_gb,
    )
    summary = run_draft_check(
        samples,
        Path(model_dir),
        vocab,
        plan.layer_ids,
        check,
        trust_remote_code=trust_remote_code,
    )
    write_summary(summary, Path(out))
    for key, value in summary["margins"].items():
        log.info(
            "trained vs %s: mean margin %.4f, worst seed %.4f (spread %.4f)",
            key,
            value["margin"],
            value["worst_margin"],
            value["spread"],
        )
    verdict = summary["criterion"]
    if verdict["passed"]:
        log.info("criterion holds: %s", verdict["rule"])
    else:
        log.warning("criterion does not hold (%s): %s", verdict["reason"], verdict["rule"])
