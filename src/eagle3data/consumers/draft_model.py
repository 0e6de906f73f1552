"""The draft itself, with speculators' own code: its settings, built on the target's final
norm, trained on the samples, and scored on held-out ones by what a speculative decoder
would accept (step-1 agreement, the acceptance length of a chain of draft steps)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import DraftCheckError, ModelConfigError
from ..hidden_states.final_state import (
    PlainRmsNorm,
    plain_rms_norm,
)
from ..schema import from_schema, schema_defaults
from .draft_data import batches, pack


@dataclass(frozen=True)
class DraftCheckSettings:
    """What one draft check trains and measures (``config/schema.yaml``, ``draft_check``)."""

    # The schema's seeds are a list; a frozen settings object keeps a tuple.
    seeds: tuple[int, ...] = dataclasses.field(
        default_factory=lambda: tuple(schema_defaults("draft_check")["seeds"])
    )
    epochs: int = from_schema("draft_check", "epochs")
    lr: float = from_schema("draft_check", "lr")
    batch_tokens: int = from_schema("draft_check", "batch_tokens")
    num_layers: int = from_schema("draft_check", "num_layers")
    ttt_steps: int = from_schema("draft_check", "ttt_steps")
    heldout_fraction: float = from_schema("draft_check", "heldout_fraction")
    split_seed: int = from_schema("draft_check", "split_seed")
    weight_decay: float = from_schema("draft_check", "weight_decay")
    fc_norm: bool = from_schema("draft_check", "fc_norm")

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
        raise DraftCheckError("no start position: no supervised token to propose")
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


def verifier_norm(model_dir: str | Path, *, trust_remote_code: bool = False) -> PlainRmsNorm:
    """The target's final norm, when it is the plain RMSNorm that speculators' teacher
    applies (``lm_head(verifier_norm(last))``); the one function the speculators export
    uses too (:func:`~eagle3data.hidden_states.final_state.plain_rms_norm`). Else one line: for
    any other norm (Gemma's ``1 + w``, LayerNorm) the teacher, and so every number, is wrong."""
    try:
        return plain_rms_norm(model_dir, trust_remote_code=trust_remote_code)
    except ModelConfigError as exc:
        raise DraftCheckError(
            f"{exc}; speculators' teacher applies that RMSNorm to the final state, so it is "
            f"wrong for this target and the draft check would measure nothing; not run"
        ) from None


def build_draft(
    model_dir: Path,
    vocab: dict[str, torch.Tensor],
    layer_ids: Sequence[int],
    *,
    num_layers: int,
    ttt_steps: int,
    seed: int,
    fc_norm: bool = False,
    trust_remote_code: bool = False,
) -> torch.nn.Module:
    """speculators' ``Eagle3DraftModel`` for the target in ``model_dir`` (its embeddings and
    head, our draft vocabulary), ``num_layers`` decoder layers, sdpa attention, float32.

    Its layers copy the text decoder's config (a wrapper's ``text_config``, read as every
    stage reads it: :func:`eagle3data.target.text_decoder_config`) where speculators has
    draft layers of its kind (llama, qwen3); for any other target (Qwen-VL, DeepSeek-V3)
    they are what speculators' own trainer builds by default, llama layers shaped from the
    text decoder (``speculators.train.cli.create_transformer_layer_config``), all full
    attention (the samples here are short)."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.model_definitions import model_classes

    from ..target import text_decoder_config

    verifier = text_decoder_config(model_dir, trust_remote_code=trust_remote_code)
    if verifier.model_type in model_classes:
        verifier.num_hidden_layers = num_layers
    else:
        verifier = _llama_draft_layers(model_dir, num_layers, trust_remote_code)
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
        trust_remote_code=trust_remote_code,
    )
    return model.float()


def _llama_draft_layers(model_dir: Path, num_layers: int, trust_remote_code: bool) -> Any:
    """speculators' default EAGLE-3 draft layers (llama) for ``model_dir``'s text decoder."""
    from speculators.train.cli import create_transformer_layer_config

    try:
        return create_transformer_layer_config(
            str(model_dir),
            num_layers,
            "llama",
            hidden_act=None,
            sliding_window=2048,  # unused: every layer has full attention
            full_attention_indices=list(range(num_layers)),
            trust_remote_code=trust_remote_code,
        )
    except (AttributeError, ValueError) as exc:
        raise DraftCheckError(
            f"{model_dir}: speculators cannot shape llama draft layers from this target's "
            f"text decoder ({exc}); the draft check cannot build its draft"
        ) from None


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
        for batch in batches(rows, settings.batch_tokens, generator):
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
    # None when the draft vocabulary is the target's whole one (speculators keeps no map).
    d2t = model.d2t  # type: ignore[attr-defined]
    totals: dict[str, float] = {}
    for row in rows:
        batch = pack([row])
        draft = model(
            hidden_states=batch["hidden_states"],
            input_ids=batch["input_ids"],
            document_ids=batch["document_ids"],
            position_ids=batch["position_ids"],
            ttt_steps=ttt_steps,
        )
        ids = torch.stack([d[0] for d in draft])  # [K, N] draft ids
        proposals = ids if d2t is None else ids + d2t[ids]  # draft id i: target i + d2t[i]
        _add(totals, chain_metrics(proposals, row["input_ids"], row["loss_mask"].bool()))
    return summarize(totals, ttt_steps)
