"""Does the target agree with the tokens it generated? The data's own end-to-end check.

For a token the target produced greedily, the target's own head applied to the
post-norm final state at position t predicts the token at t + 1 (shards holding the
pre-norm state go through the target's own final norm first: :mod:`.final_state`).
Everything that can silently break EAGLE-3 data breaks that: token ids from another
tokenizer, a rendered prompt that differs from what the target saw while generating
(reasoning dropped from history), states of another model, a pre-norm state recorded as
post-norm, states shifted against the tokens. So the validate job measures, on a seeded
sample of positions per shard:

* **agreement**: argmax(lm_head(last[t])) == input_ids[t + 1], over positions whose next
  token the target produced (supervised, and not written by the template: after an
  end-of-turn token, such as ChatML's newline after ``<|im_end|>``, or closing a turn cut
  at max_tokens, such as Kimi's ``</think><|im_end|>``);
* **mean log-probability** of that token;
* the same two for the token at t + 2: the **control**, what a one-token misalignment
  would score (states shifted by one row against the tokens score *there*).

Greedy data (temperature 0) must agree well above the control; sampled data is judged by
log-probability against the control. Aux layers do not enter: their ids are checked
against the rule separately (:func:`aux_layer_errors`).

Only the head is loaded, straight from the checkpoint's safetensors (or ``.bin``) files:
Kimi-K2.5's is 163,840 x 7168, a few GB, where the whole model is a terabyte. Logits are
computed in vocabulary chunks, so memory stays at one chunk of the head in float32.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from .. import model_config
from ..errors import ModelConfigError, ValidationError
from ..schema import from_schema
from . import checkpoint_tensors
from .checkpoint_tensors import read_tensor
from .final_state import PRE_NORM, FinalNorm, final_state_of

log = logging.getLogger(__name__)

# Vocabulary rows per logits chunk: 32768 x 7168 float32 is ~0.9 GB.
_VOCAB_CHUNK = 32768
_HEAD_SUFFIX = "lm_head.weight"
_TIED_SUFFIX = "embed_tokens.weight"


@dataclass(frozen=True)
class AgreementSettings:
    """``validate.agreement``, parsed once by the validate job (what each key means: the
    schema's descriptions; an object built by hand gets the schema's defaults)."""

    enabled: bool = from_schema("validate", "agreement", "enabled")
    positions_per_shard: int | Literal["all"] = from_schema(
        "validate", "agreement", "positions_per_shard"
    )
    min_agreement: float = from_schema("validate", "agreement", "min_agreement")
    min_agreement_margin: float = from_schema("validate", "agreement", "min_agreement_margin")
    min_logprob_margin: float = from_schema("validate", "agreement", "min_logprob_margin")
    min_sampled_agreement: float = from_schema("validate", "agreement", "min_sampled_agreement")

    @classmethod
    def parse(cls, section: Mapping[str, Any]) -> AgreementSettings:
        """The config's section (validated: only these keys)."""
        return cls(**section)

    def to_json(self) -> dict[str, Any]:
        """As the manifest's agreement section records them."""
        return asdict(self)


LIKELY_CAUSES = (
    "token ids not from the target's own tokenizer (model.tokenizer, a converted stand-in); "
    "a rendered prompt that differs from what the target saw while generating (history "
    "reasoning dropped: tokenize.reasoning, chat_template_kwargs); responses not generated "
    "by this model (generation.backend / the server's model); states of another model or "
    "not the final post-norm state; states misaligned with the tokens (loss mask or rows "
    "off by one)"
)


@dataclass
class AgreementStats:
    """Sums over sampled positions; ``combine`` adds shards, ``summary`` gives the rates."""

    positions: int = 0
    agree: int = 0
    logprob_sum: float = 0.0
    control_positions: int = 0
    control_agree: int = 0
    control_logprob_sum: float = 0.0

    def combine(self, other: AgreementStats) -> AgreementStats:
        pairs = zip(self.astuple(), other.astuple(), strict=True)
        return AgreementStats(*(a + b for a, b in pairs))

    def astuple(self) -> tuple[Any, ...]:
        return tuple(asdict(self).values())

    def summary(self) -> dict[str, Any]:
        def rate(x: float, n: int) -> float | None:
            return round(x / n, 6) if n else None

        return {
            "positions": self.positions,
            "agreement": rate(self.agree, self.positions),
            "mean_logprob": rate(self.logprob_sum, self.positions),
            "control_positions": self.control_positions,
            "control_agreement": rate(self.control_agree, self.control_positions),
            "control_mean_logprob": rate(self.control_logprob_sum, self.control_positions),
        }


# ----------------------------------------------------------------------------- the head


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> file (:mod:`.checkpoint_tensors`); a model without weight
    files is this check's error."""
    try:
        return checkpoint_tensors.weight_files(
            model_dir,
            "to read the lm_head from (validate.agreement needs it; set "
            "validate.agreement.enabled: false to skip the check)",
        )
    except ModelConfigError as exc:
        raise ValidationError(str(exc)) from None


def head_tensor_name(names: Iterable[str]) -> str:
    """The text decoder's output head: ``lm_head.weight`` (a wrapper's nested one, e.g.
    ``language_model.lm_head.weight``), else the tied input embedding."""
    names = list(names)
    for suffix in (_HEAD_SUFFIX, _TIED_SUFFIX):
        found = sorted((n for n in names if n == suffix or n.endswith("." + suffix)), key=len)
        if found:
            return found[0]
    raise ValidationError(f"the checkpoint has no {_HEAD_SUFFIX} nor a tied {_TIED_SUFFIX}")


def load_head(model_path: str | Path) -> torch.Tensor:
    """The target's ``[V, H]`` output head, as stored (no other weight is read)."""
    model_dir = Path(model_path)
    files = weight_files(model_dir)
    name = head_tensor_name(files)
    head = read_tensor(files[name], name)
    if not head.is_floating_point() or head.dtype.itemsize < 2 or head.ndim != 2:
        raise ValidationError(
            f"{files[name]}: {name} is {head.dtype} {list(head.shape)}; the agreement check "
            f"reads a bf16/fp16/fp32 [vocab, hidden] head (a quantized head is not supported: "
            f"set validate.agreement.enabled: false)"
        )
    return head


def end_of_turn_ids(model_path: str | Path) -> set[int]:
    """``eos_token_id`` of the generation config and the model config (int or list)."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = Path(model_path) / name
        if not path.is_file():
            continue
        ids |= model_config.eos_token_ids(json.loads(path.read_text()))
    return ids


# ------------------------------------------------------------------------ positions


@dataclass(frozen=True)
class TurnRecord:
    """What the engine reported for one assistant turn of a response."""

    message_index: int
    completion_tokens: int
    truncated: bool  # finish_reason "length": the template closed what the target did not


def turn_records(response: Mapping[str, Any]) -> list[TurnRecord]:
    """The assistant turns of a response record, in order (empty when not recorded)."""
    indices = [i for i, m in enumerate(response["messages"]) if m.get("role") == "assistant"]
    turns = response.get("turns") or []
    if len(turns) != len(indices):
        return []
    return [
        TurnRecord(i, int(t.get("completion_tokens") or 0), t.get("finish_reason") == "length")
        for i, t in zip(indices, turns, strict=True)
    ]


def template_tails(
    loss_mask: np.ndarray,
    offsets: np.ndarray,
    sample_ids: Sequence[str],
    turns: Mapping[str, Sequence[TurnRecord]],
) -> np.ndarray:
    """Rows the template wrote after a truncated turn's produced tokens.

    A turn cut at max_tokens ends where the target stopped, and the re-render closes it
    (Kimi: ``</think><|im_end|>``): supervised, but not produced. The first
    ``completion_tokens`` supervised tokens of such a turn's span are the target's; the
    rest of the span is marked. Spans are matched to turns in order: a sample ``{id}#{i}``
    holds the turns from message index i on (tokenization.table), a whole conversation
    all of them.
    """
    tails = np.zeros(len(loss_mask), dtype=bool)
    for k, sample_id in enumerate(sample_ids):
        response_id, _, turn = sample_id.partition("#")
        records = list(turns.get(response_id, ()))
        if turn:
            records = [r for r in records if r.message_index >= int(turn)]
        start, end = int(offsets[k]), int(offsets[k + 1])
        mask = loss_mask[start:end].astype(np.int8)
        edges = np.diff(np.concatenate([[0], mask, [0]]))
        spans = zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True)
        for (first, stop), record in zip(spans, records, strict=False):
            if record.truncated and record.completion_tokens < stop - first:
                tails[start + first + record.completion_tokens : start + stop] = True
    return tails


def produced_positions(
    input_ids: np.ndarray,
    loss_mask: np.ndarray,
    offsets: np.ndarray,
    end_of_turn: set[int],
    template_rows: np.ndarray | None = None,
) -> np.ndarray:
    """Rows t whose next token (t + 1, same sample) the target produced: supervised, not
    right after an end-of-turn token (what follows it is the template's), and not among
    ``template_rows`` (see :func:`template_tails`)."""
    total = len(input_ids)
    if total < 2:
        return np.zeros(0, dtype=np.int64)
    next_supervised = loss_mask[1:].astype(bool)
    if template_rows is not None:
        next_supervised &= ~template_rows[1:]
    # The last row of each sample has no next token in that sample.
    sample_end = np.zeros(total - 1, dtype=bool)
    ends = offsets[1:] - 1
    sample_end[ends[(ends >= 0) & (ends < total - 1)]] = True
    after_eot = np.isin(input_ids[:-1], list(end_of_turn)) if end_of_turn else False
    keep = next_supervised & ~sample_end & ~after_eot
    return np.flatnonzero(keep)


def sample_positions(positions: np.ndarray, count: int | None, seed: int) -> np.ndarray:
    """A seeded, sorted sample of ``count`` positions (all of them for None or more)."""
    if count is None or len(positions) <= count:
        return positions
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(positions, size=count, replace=False))


# ------------------------------------------------------------------------ scoring


def score(
    states: torch.Tensor, targets: torch.Tensor, controls: torch.Tensor, head: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target agrees, target log-prob, control agrees, control log-prob) per state row.

    Vocabulary-chunked: a running max/argmax and log-sum-exp, so the full ``[n, V]``
    logits never exist. ``controls`` may hold -1 (no control token for that row)."""
    h = states.float()
    n = h.shape[0]
    best = torch.full((n,), -torch.inf)
    best_id = torch.zeros(n, dtype=torch.long)
    lse = torch.full((n,), -torch.inf)
    target_logit = torch.zeros(n)
    control_logit = torch.zeros(n)
    rows = torch.arange(n)
    for start in range(0, head.shape[0], _VOCAB_CHUNK):
        chunk = head[start : start + _VOCAB_CHUNK].float()
        logits = h @ chunk.T
        value, index = logits.max(dim=1)
        better = value > best
        best = torch.where(better, value, best)
        best_id = torch.where(better, index + start, best_id)
        lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=1))
        for ids, out in ((targets, target_logit), (controls, control_logit)):
            inside = (ids >= start) & (ids < start + chunk.shape[0])
            out[inside] = logits[rows[inside], ids[inside] - start]
    return (
        best_id == targets,
        target_logit - lse,
        best_id == controls,
        control_logit - lse,
    )


def shard_agreement(
    shard: Any,
    head: torch.Tensor,
    end_of_turn: set[int],
    positions_per_shard: int | None,
    seed: int,
    turns: Mapping[str, Sequence[TurnRecord]] | None = None,
    final_norm: FinalNorm | None = None,
) -> AgreementStats:
    """Agreement over a seeded sample of one open shard's produced positions
    (``turns``: the response records' turns by response id, see :func:`template_tails`;
    ``final_norm``: the target's, for a shard holding the pre-norm state)."""
    input_ids = np.asarray(shard.input_ids, dtype=np.int64)
    offsets = np.asarray(shard.sample_offsets, dtype=np.int64)
    loss_mask = np.asarray(shard.loss_mask)
    tails = template_tails(loss_mask, offsets, shard.sample_ids, turns) if turns else None
    positions = produced_positions(input_ids, loss_mask, offsets, end_of_turn, tails)
    chosen = sample_positions(positions, positions_per_shard, seed)
    if len(chosen) == 0:
        return AgreementStats()
    if shard.hidden_size != head.shape[1]:
        raise ValidationError(
            f"{shard.path}: hidden size {shard.hidden_size}, but the model's head takes "
            f"{head.shape[1]}: the states are not this model's"
        )
    last = shard.last_hidden_states(as_torch=True)[torch.from_numpy(chosen)]
    if final_state_of(getattr(shard, "attrs", {}), shard.path) == PRE_NORM:
        if final_norm is None:
            raise ValidationError(
                f"{shard.path}: holds the pre-norm final state; the agreement check needs "
                f"the target's final norm to score it"
            )
        last = final_norm.to(last.dtype)(last)
    targets = torch.from_numpy(input_ids[chosen + 1])
    # The control token t + 2 must lie in the same sample as t.
    sample_of = np.searchsorted(offsets, chosen, side="right") - 1
    has_control = chosen + 2 < offsets[sample_of + 1]
    controls = torch.from_numpy(
        np.where(has_control, input_ids[np.minimum(chosen + 2, len(input_ids) - 1)], -1)
    )
    agree, logprob, c_agree, c_logprob = score(last, targets, controls, head)
    has = torch.from_numpy(has_control)
    return AgreementStats(
        positions=len(chosen),
        agree=int(agree.sum()),
        logprob_sum=float(logprob.sum()),
        control_positions=int(has.sum()),
        control_agree=int((c_agree & has).sum()),
        control_logprob_sum=float(c_logprob[has].sum()),
    )


# ------------------------------------------------------------------------ judging


def judge(summary: Mapping[str, Any], *, greedy: bool, settings: AgreementSettings) -> list[str]:
    """Why the dataset's agreement fails its thresholds (empty: it passes)."""
    if not summary["positions"]:
        return []
    agreement, control = summary["agreement"], summary["control_agreement"] or 0.0
    logprob, control_lp = summary["mean_logprob"], summary["control_mean_logprob"]
    problems = []
    if greedy:
        if agreement < settings.min_agreement:
            problems.append(
                f"agreement {agreement:.4f} < validate.agreement.min_agreement "
                f"{settings.min_agreement} (greedy data)"
            )
        if agreement - control < settings.min_agreement_margin:
            problems.append(
                f"agreement {agreement:.4f} is not {settings.min_agreement_margin} above "
                f"the one-token-shifted control {control:.4f} (min_agreement_margin)"
            )
    else:
        if control_lp is not None and logprob - control_lp < settings.min_logprob_margin:
            problems.append(
                f"mean log-probability {logprob:.3f} is not {settings.min_logprob_margin} "
                f"nats above the one-token-shifted control {control_lp:.3f} (sampled data, "
                f"min_logprob_margin)"
            )
        if agreement < settings.min_sampled_agreement:
            problems.append(
                f"agreement {agreement:.4f} < validate.agreement.min_sampled_agreement "
                f"{settings.min_sampled_agreement} (sampled data)"
            )
    return problems


def failure_message(dataset: str, summary: Mapping[str, Any], problems: Sequence[str]) -> str:
    return (
        f"{dataset}: the target does not agree with the tokens it generated "
        f"({summary['positions']} positions): "
        + "; ".join(problems)
        + ". Likely causes: "
        + LIKELY_CAUSES
        + ". The numbers are in the validate log; the manifest is not written."
    )
