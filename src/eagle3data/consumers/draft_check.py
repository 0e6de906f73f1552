"""Does a draft trained on our shards beat a control? EAGLE-3 on CPU with speculators' own code.

The model and the loss are vLLM speculators' own (``Eagle3DraftModel`` with sdpa attention,
its eager KL loss and its own ``shift_batch`` alignment); only the training loop is ours,
because its ``Trainer`` moves the model to an accelerator unconditionally. Three drafts share
the init seed and the held-out conversations:

- ``trained``: trained on the shards as they are;
- ``shifted``: trained on the same data with every hidden state (aux and final) moved one
  position later than its token (row t holds the states of row t-1): the broken link the
  validate stage's agreement check catches;
- ``untrained``: the init, never trained.

Metrics (:func:`chain_metrics`), on conversations held out by a seeded split
(:func:`split_conversations`). With speculators' alignment, position t of a conversation
feeds the draft the target's aux states g_t and token x_{t+1}; draft step k (k = 1..K)
proposes the token x_{t+1+k}. Verification is greedy against the target's own tokens: the
target produced the response tokens (the demo generates greedily), so the draft's step-k
token is accepted when it and every earlier step's token equal the tokens the target
produced there, and each of those tokens is supervised (``loss_mask`` 1: the target
produced it; a prompt token or the end of the conversation ends the chain). Start
positions are those whose first proposed token is supervised.

- ``step1_agreement``: the fraction of start positions whose step-1 token is accepted;
- ``acceptance_length``: E[number of consecutive accepted draft tokens out of K] over start
  positions (0..K; the bonus token the target adds on verification is not counted).

Steps 2..K feed the draft its own previous hidden output (as EAGLE-3 test-time training
does) and, as speculators' forward does, the data's token at that position; on an accepted
prefix that token is the draft's own prediction, so the accepted count is exactly what
inference feeding the draft its own tokens would accept.

The final state: speculators computes its teacher as ``lm_head(verifier_norm(last))`` from the
PRE-norm state, which shards extracted with ``final_state: pre_norm`` hold. From post-norm
shards: RMSNorm is scale-invariant, so ``post / norm_weight`` (:func:`prenorm_from_postnorm`)
is a pre-norm state the verifier norm maps back onto ``post`` exactly up to its epsilon.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..hidden_states.final_state import PRE_NORM, final_state_of

log = logging.getLogger(__name__)

__all__ = [
    "CONTROLS",
    "DraftCheckSettings",
    "Sample",
    "chain_metrics",
    "load_samples",
    "prenorm_from_postnorm",
    "run_draft_check",
    "shift_states",
    "split_conversations",
    "summarize",
]

VARIANTS = ("trained", "shifted", "untrained")
CONTROLS = ("shifted", "untrained")


@dataclass(frozen=True)
class DraftCheckSettings:
    """What one draft check trains and measures (``config/schema.yaml``, ``draft_check``)."""

    seeds: tuple[int, ...] = (0, 1, 2)
    epochs: int = 10
    lr: float = 1e-3
    batch_tokens: int = 512
    num_layers: int = 1
    ttt_steps: int = 3
    heldout_fraction: float = 0.25
    split_seed: int = 0
    weight_decay: float = 0.0
    fc_norm: bool = True

    def __post_init__(self) -> None:
        if not self.seeds:
            raise ValueError("draft_check.seeds: at least one seed")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(
                f"draft_check.heldout_fraction must be in (0, 1), got {self.heldout_fraction}"
            )
        for name in ("epochs", "batch_tokens", "num_layers", "ttt_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"draft_check.{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_config(cls, section: dict[str, Any]) -> DraftCheckSettings:
        known = {k: v for k, v in section.items() if k in cls.__dataclass_fields__}
        if "seeds" in known:
            known["seeds"] = tuple(int(s) for s in known["seeds"])
        return cls(**known)


@dataclass
class Sample:
    """One conversation: token ids, loss mask, aux states [L, 3H], final state [L, H]
    (pre-norm when ``pre_norm``, else post-norm)."""

    id: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux_hidden_states: torch.Tensor
    last_hidden_states: torch.Tensor
    pre_norm: bool = False


# --------------------------------------------------------------------------- data


def load_samples(shard_dirs: Sequence[str | Path]) -> list[Sample]:
    """Every conversation of the shard directories, states in float32."""
    from eagle3data.loader import HiddenStateDataset

    dataset = HiddenStateDataset([str(d) for d in shard_dirs])
    try:
        out = []
        for i in range(len(dataset)):
            item = dataset[i]
            out.append(
                Sample(
                    id=f"{item['dataset']}/{item['id']}",
                    input_ids=item["input_ids"],
                    loss_mask=item["loss_mask"],
                    aux_hidden_states=item["aux_hidden_states"].float(),
                    last_hidden_states=item["last_hidden_states"].float(),
                    pre_norm=dataset.final_state == PRE_NORM,
                )
            )
        return out
    finally:
        dataset.close()


def split_conversations(
    ids: Sequence[str], heldout_fraction: float, seed: int
) -> tuple[list[int], list[int]]:
    """(train, held-out) indices: conversations ordered by a seeded hash of their id, the
    first ``ceil(fraction * n)`` held out (at least one, and at least one left to train).

    The split depends only on the ids and the seed, not on their order or count elsewhere.
    """
    if len(ids) < 2:
        raise ValueError(f"need at least 2 conversations to hold some out, got {len(ids)}")
    if len(set(ids)) != len(ids):
        raise ValueError("conversation ids are not unique")

    def key(i: int) -> str:
        return hashlib.sha256(f"{seed}\0{ids[i]}".encode()).hexdigest()

    order = sorted(range(len(ids)), key=key)
    n_held = min(len(ids) - 1, max(1, math.ceil(heldout_fraction * len(ids))))
    return sorted(order[n_held:]), sorted(order[:n_held])


def shift_states(sample: Sample, offset: int = 1) -> Sample:
    """The control: every state moved ``offset`` rows later than its token (row t holds the
    states of row t - offset; the first rows are zeros), tokens and mask unchanged."""
    if offset < 1:
        raise ValueError(f"offset must be >= 1, got {offset}")

    def late(x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        if x.shape[0] > offset:
            out[offset:] = x[:-offset]
        return out

    return Sample(
        sample.id,
        sample.input_ids,
        sample.loss_mask,
        late(sample.aux_hidden_states),
        late(sample.last_hidden_states),
        sample.pre_norm,
    )


def prenorm_from_postnorm(post: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """A pre-norm state whose RMSNorm (weight ``norm_weight``) is ``post`` up to the epsilon.

    ``post = w * x / rms(x)``, so ``post / w = x / rms(x)`` has RMS 1 and RMSNorm maps it back
    onto ``post``. A zero weight loses information and is refused.
    """
    if bool((norm_weight == 0).any()):
        raise ValueError("the final norm has a zero weight: its input cannot be recovered")
    return post / norm_weight.to(post.dtype)


def _speculators_row(sample: Sample, norm_weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """One conversation in speculators' batch layout, aligned by its own ``shift_batch``."""
    from speculators.models.eagle3.data import shift_batch

    n = int(sample.input_ids.shape[0])
    return shift_batch(
        {
            "input_ids": sample.input_ids.long(),
            "hidden_states": sample.aux_hidden_states.float(),
            "verifier_last_hidden_states": sample.last_hidden_states.float()
            if sample.pre_norm
            else prenorm_from_postnorm(sample.last_hidden_states.float(), norm_weight),
            "loss_mask": sample.loss_mask.long(),
            "lengths": torch.tensor([n]),
            "position_ids": torch.arange(n),
        }
    )


def _pack(rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Rows packed into one [1, T] sequence with document ids (speculators' batch shape)."""
    doc = torch.cat([torch.full((int(r["input_ids"].shape[0]),), i) for i, r in enumerate(rows)])
    batch = {
        key: torch.cat([r[key] for r in rows]).unsqueeze(0)
        for key in (
            "input_ids",
            "hidden_states",
            "verifier_last_hidden_states",
            "loss_mask",
            "position_ids",
        )
    }
    batch["document_ids"] = doc.unsqueeze(0)
    return batch


def _batches(
    rows: Sequence[dict[str, torch.Tensor]], batch_tokens: int, generator: torch.Generator
) -> Iterator[dict[str, torch.Tensor]]:
    """Rows in a seeded random order, packed greedily up to ``batch_tokens`` tokens."""
    order = torch.randperm(len(rows), generator=generator).tolist()
    current: list[dict[str, torch.Tensor]] = []
    size = 0
    for i in order:
        n = int(rows[i]["input_ids"].shape[0])
        if current and size + n > batch_tokens:
            yield _pack(current)
            current, size = [], 0
        current.append(rows[i])
        size += n
    if current:
        yield _pack(current)


# --------------------------------------------------------------------------- metrics


def chain_metrics(
    proposals: torch.Tensor, tokens: torch.Tensor, supervised: torch.Tensor
) -> dict[str, float]:
    """Greedy-verification metrics of K-step draft proposals over one sequence.

    ``proposals`` [K, N]: the token (target ids) draft step k+1 proposes at start position t,
    for the token at ``tokens[t + 1 + k]``; ``tokens`` [N] and ``supervised`` [N] (bool): the
    sequence and which of its tokens the target produced. Step k+1 at t is accepted when every
    step j <= k+1 proposed ``tokens[t + j]`` and that token is supervised and inside the
    sequence. Start positions: t with ``supervised[t + 1]``.

    Returns sums, so that sequences add: ``starts``, ``accepted`` (sum over starts of the
    accepted-chain length, 0..K) and ``accepted_step{k}`` (starts whose first k steps were
    all accepted).
    """
    if proposals.dim() != 2 or tokens.dim() != 1 or supervised.shape != tokens.shape:
        raise ValueError("proposals [K, N], tokens [N] and supervised [N] expected")
    k_steps, n = proposals.shape
    if n != tokens.shape[0]:
        raise ValueError(f"proposals cover {n} positions, the sequence has {tokens.shape[0]}")
    # label[k, t] = tokens[t + 1 + k]; positions past the end are never accepted.
    labels = torch.full((k_steps, n), -1, dtype=torch.long)
    ok = torch.zeros((k_steps, n), dtype=torch.bool)
    sup = supervised.bool()
    for k in range(k_steps):
        if n > 1 + k:
            labels[k, : n - 1 - k] = tokens[1 + k :].long()
            ok[k, : n - 1 - k] = sup[1 + k :]
    hit = (proposals.long() == labels) & ok
    chain = torch.cumprod(hit.long(), dim=0).bool()  # accepted through step k
    starts = ok[0]
    out = {"starts": float(starts.sum()), "accepted": float(chain[:, starts].sum())}
    for k in range(k_steps):
        out[f"accepted_step{k + 1}"] = float(chain[k, starts].sum())
    return out


def summarize(totals: dict[str, float], k_steps: int) -> dict[str, float]:
    """Rates from summed :func:`chain_metrics`: ``step1_agreement``, ``acceptance_length``
    (out of ``k_steps``) and ``step{k}_chain`` (fraction of starts accepted through step k)."""
    starts = totals.get("starts", 0.0)
    if starts <= 0:
        raise ValueError("no start position: no supervised token to propose")
    out = {
        "positions": starts,
        "step1_agreement": totals["accepted_step1"] / starts,
        "acceptance_length": totals["accepted"] / starts,
    }
    for k in range(1, k_steps + 1):
        out[f"step{k}_chain"] = totals[f"accepted_step{k}"] / starts
    return out


def _add(totals: dict[str, float], part: dict[str, float]) -> None:
    for key, value in part.items():
        totals[key] = totals.get(key, 0.0) + value


# --------------------------------------------------------------------------- model


def _norm_weight(model_dir: Path) -> torch.Tensor:
    from speculators.utils.loading import load_model_layers

    return load_model_layers(["model.norm.weight"], str(model_dir))["model.norm.weight"].float()


def build_draft(
    model_dir: Path,
    vocab: dict[str, torch.Tensor],
    layer_ids: Sequence[int],
    *,
    num_layers: int,
    ttt_steps: int,
    seed: int,
    fc_norm: bool = False,
) -> torch.nn.Module:
    """speculators' ``Eagle3DraftModel`` for the target in ``model_dir`` (its embeddings and
    head, our draft vocabulary), ``num_layers`` decoder layers, sdpa attention, float32."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers import AutoConfig

    verifier = AutoConfig.from_pretrained(str(model_dir))
    verifier = getattr(verifier, "text_config", verifier)
    verifier.num_hidden_layers = num_layers
    torch.manual_seed(seed)
    model = Eagle3DraftModel.from_training_args(
        verifier,
        t2d=vocab["t2d"].bool(),
        d2t=vocab["d2t"].long(),
        verifier_name_or_path=str(model_dir),
        target_layer_ids=list(layer_ids),
        draft_attn_impl="sdpa",
        draft_vocab_size=int(vocab["d2t"].shape[0]),
        norm_before_residual=True,
        fc_norm=fc_norm,
        ttt_steps=ttt_steps,
    )
    return model.float()


def train_draft(
    model: torch.nn.Module,
    rows: Sequence[dict[str, torch.Tensor]],
    settings: DraftCheckSettings,
    seed: int,
    on_epoch: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Our loop around speculators' forward and eager KL loss; the mean loss per epoch."""
    from speculators.losses import resolve_loss_config

    loss_config = resolve_loss_config("kl_div", "eager")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    losses = []
    for epoch in range(settings.epochs):
        total, count = 0.0, 0
        for batch in _batches(rows, settings.batch_tokens, generator):
            _, loss, _ = model(
                **batch,
                ttt_steps=settings.ttt_steps,
                ttt_step_loss_decay=1.0,
                loss_config=loss_config,
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            total += float(loss.detach())
            count += 1
        losses.append(total / max(count, 1))
        if on_epoch is not None:
            on_epoch(epoch, losses[-1])
    return losses


@torch.no_grad()
def evaluate_draft(
    model: torch.nn.Module, rows: Sequence[dict[str, torch.Tensor]], ttt_steps: int
) -> dict[str, float]:
    """:func:`summarize` of the draft's proposals over held-out rows, one conversation at a time."""
    model.eval()
    d2t = model.d2t  # type: ignore[attr-defined]
    totals: dict[str, float] = {}
    for row in rows:
        batch = _pack([row])
        draft = model(
            hidden_states=batch["hidden_states"],
            input_ids=batch["input_ids"],
            document_ids=batch["document_ids"],
            position_ids=batch["position_ids"],
            ttt_steps=ttt_steps,
        )
        ids = torch.stack([d[0] for d in draft])  # [K, N] draft ids
        proposals = ids + d2t[ids]  # draft id i is target id i + d2t[i]
        _add(totals, chain_metrics(proposals, row["input_ids"], row["loss_mask"].bool()))
    return summarize(totals, ttt_steps)


# --------------------------------------------------------------------------- the check


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
) -> dict[str, Any]:
    """Train and measure each variant for each seed; the summary (see :func:`margins`)."""
    variants = tuple(variants)
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}; known: {VARIANTS}")
    norm_weight = _norm_weight(model_dir)
    train_idx, held_idx = split_conversations(
        [s.id for s in samples], settings.heldout_fraction, settings.split_seed
    )
    train_rows = [_speculators_row(samples[i], norm_weight) for i in train_idx]
    shifted_rows = [_speculators_row(shift_states(samples[i]), norm_weight) for i in train_idx]
    held_rows = [_speculators_row(samples[i], norm_weight) for i in held_idx]
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
        )
        for variant in variants:
            start = time.monotonic()
            model = copy.deepcopy(init)
            losses: list[float] = []
            if variant != "untrained":
                rows = train_rows if variant == "trained" else shifted_rows
                losses = train_draft(model, rows, settings, seed)
            metrics = evaluate_draft(model, held_rows, settings.ttt_steps)
            result = VariantResult(seed, variant, metrics, losses, time.monotonic() - start)
            log.info(
                "seed %d %-9s step1 %.4f  acceptance %.4f / %d  (%.0f s)",
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
        "conversations": {"train": len(train_idx), "heldout": len(held_idx)},
        "heldout_ids": [samples[i].id for i in held_idx],
        "train_tokens": int(sum(int(r["input_ids"].shape[0]) for r in train_rows)),
        "runs": [asdict(r) for r in results],
    }
    summary["aggregate"] = aggregate(results)
    summary["margins"] = margins(results)
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
    """For each control and metric: min over seeds of ``trained`` minus max over seeds of the
    control (positive: every trained seed beats every control seed), and the seed-to-seed
    spreads (max - min): ``trained_spread``, ``control_spread`` and the larger, ``spread``."""
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
                "margin": min(t) - max(c),
                "spread": max(max(t) - min(t), max(c) - min(c)),
                "trained_spread": max(t) - min(t),
                "control_spread": max(c) - min(c),
            }
    return out


def write_summary(summary: dict[str, Any], path: Path) -> None:
    """The summary as JSON, written aside and renamed into place."""
    from eagle3data.atomic import write_json

    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, summary)


def draft_check(
    *,
    shard_dirs: Sequence[str],
    draft_vocab: str,
    model_dir: str,
    out: str,
    settings: dict[str, Any],
    num_threads: int = 1,
) -> None:
    """Stage function: the check over validated shard directories, ``out`` (summary JSON)."""
    import json

    check = DraftCheckSettings.from_config(settings)
    torch.set_num_threads(max(1, num_threads))
    layer_ids = None
    for directory in shard_dirs:
        attrs = json.loads((Path(directory) / "manifest.json").read_text(encoding="utf-8"))["attrs"]
        final_state_of(attrs, directory)
        ids = list(attrs["aux_hidden_states_indices"])
        if layer_ids is not None and ids != layer_ids:
            raise ValueError(f"{directory}: aux layers {ids} differ from {layer_ids}")
        layer_ids = ids
    assert layer_ids is not None
    vocab = torch.load(draft_vocab, map_location="cpu", weights_only=True)
    samples = load_samples(shard_dirs)
    log.info(
        "%d conversations, %d tokens, aux layers %s",
        len(samples),
        sum(len(s.input_ids) for s in samples),
        layer_ids,
    )
    summary = run_draft_check(samples, Path(model_dir), vocab, layer_ids, check)
    write_summary(summary, Path(out))
    for key, value in summary["margins"].items():
        log.info("trained vs %s: margin %.4f (spread %.4f)", key, value["margin"], value["spread"])
