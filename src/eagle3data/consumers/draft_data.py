"""The draft check's data: the validated shards' conversations as samples, split by
conversation into training and held-out sets, and the controls made from them (states
shifted by one token, aux states shuffled across samples), packed into speculators'
training rows."""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import DraftCheckError
from ..hidden_states.final_state import PRE_NORM, PlainRmsNorm


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


def load_samples(shard_dirs: Sequence[str | Path]) -> list[Sample]:
    """Every conversation of the shard directories, states in float32, all in memory (the
    stage function first refuses shards over its bound: :func:`check_memory`)."""
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


_TURN_SUFFIX = re.compile(r"#\d+$")


def conversation_keys(samples: Sequence[Sample]) -> list[str]:
    """Per sample, the key the held-out split draws by: a hash of its conversation's first
    prompt as the target read it.

    The prompts table's ``prompt_hash`` is not in the shards, so the key is derived from what
    is: a conversation's samples are its whole sample or its per-turn samples ``{id}#{turn}``
    (one dataset, one id), and the tokens before the first supervised token of its earliest
    sample are the rendered first prompt (system, first user turn, assistant header). The same
    prompt in two datasets renders to the same tokens, so it gets the same key; with greedy
    decoding its answer is the same too.
    """
    groups: dict[str, list[int]] = {}
    for i, sample in enumerate(samples):
        groups.setdefault(_TURN_SUFFIX.sub("", sample.id), []).append(i)
    keys = [""] * len(samples)
    for members in groups.values():
        first = min(members, key=lambda i: _turn_of(samples[i].id))
        prompt = _prompt_tokens(samples[first])
        key = hashlib.sha256(prompt.numpy().astype("<i8").tobytes()).hexdigest()[:16]
        for i in members:
            keys[i] = key
    return keys


def _turn_of(sample_id: str) -> int:
    match = _TURN_SUFFIX.search(sample_id)
    return int(match.group()[1:]) if match else -1


def _prompt_tokens(sample: Sample) -> torch.Tensor:
    """The tokens before the first supervised one (all of them when none is)."""
    supervised = sample.loss_mask.nonzero()
    end = int(supervised[0]) if len(supervised) else len(sample.input_ids)
    return sample.input_ids[:end].long()


def split_conversations(
    keys: Sequence[str], heldout_fraction: float, seed: int
) -> tuple[list[int], list[int]]:
    """(train, held-out) sample indices: samples sharing a key (:func:`conversation_keys`) are
    one conversation; conversations ordered by a seeded hash of their key, the first
    ``ceil(fraction * n)`` held out (at least one, and at least one left to train).

    The split depends only on the keys and the seed, not on their order or count elsewhere.
    """
    conversations = list(dict.fromkeys(keys))
    if len(conversations) < 2:
        raise DraftCheckError(
            f"need at least 2 conversations to hold some out, got {len(conversations)}"
        )

    def order(key: str) -> str:
        return hashlib.sha256(f"{seed}\0{key}".encode()).hexdigest()

    ranked = sorted(conversations, key=order)
    n_held = min(len(ranked) - 1, max(1, math.ceil(heldout_fraction * len(ranked))))
    held = set(ranked[:n_held])
    indices = range(len(keys))
    return [i for i in indices if keys[i] not in held], [i for i in indices if keys[i] in held]


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


def shuffle_aux_states(samples: Sequence[Sample], seed: int) -> list[Sample]:
    """The aux control: every position's aux states replaced by those of another position of
    ``samples`` (one seeded cycle through all positions, so no row keeps its own); tokens, loss
    masks and final states (the teacher) are the samples' own."""
    lengths = [int(s.aux_hidden_states.shape[0]) for s in samples]
    rows = torch.cat([s.aux_hidden_states for s in samples])
    order = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(seed))
    moved = torch.empty_like(rows)
    # Row order[i] takes row order[i - 1]: a single cycle, real states from elsewhere.
    moved[order] = rows[order.roll(1)]
    return [
        Sample(s.id, s.input_ids, s.loss_mask, aux, s.last_hidden_states, s.pre_norm)
        for s, aux in zip(samples, moved.split(lengths), strict=True)
    ]


def training_vocab(
    samples: Sequence[Sample], size: int, target_vocab: int
) -> dict[str, torch.Tensor]:
    """The draft vocabulary (``d2t``, ``t2d``) of the samples' supervised tokens, chosen as the
    workflow's own (:func:`eagle3data.consumers.vocab.draft_vocab`)."""
    from collections import Counter

    from eagle3data.consumers.vocab import draft_vocab

    counts: Counter[int] = Counter()
    for s in samples:
        counts.update(s.input_ids[s.loss_mask.bool()].tolist())
    vocab = draft_vocab(counts, size, target_vocab)
    return {"d2t": vocab.d2t, "t2d": vocab.t2d}


def speculators_row(sample: Sample, norm: PlainRmsNorm) -> dict[str, torch.Tensor]:
    """One conversation in speculators' batch layout, aligned by its own ``shift_batch``
    (a post-norm final state restored to the pre-norm one ``norm`` maps onto it)."""
    from speculators.models.eagle3.data import shift_batch

    n = int(sample.input_ids.shape[0])
    return shift_batch(
        {
            "input_ids": sample.input_ids.long(),
            "hidden_states": sample.aux_hidden_states.float(),
            "verifier_last_hidden_states": sample.last_hidden_states.float()
            if sample.pre_norm
            else norm.prenorm_of(sample.last_hidden_states),
            "loss_mask": sample.loss_mask.long(),
            "lengths": torch.tensor([n]),
            "position_ids": torch.arange(n),
        }
    )


def pack(rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
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


def batches(
    rows: Sequence[dict[str, torch.Tensor]], batch_tokens: int, generator: torch.Generator
) -> Iterator[dict[str, torch.Tensor]]:
    """Rows in a seeded random order, packed greedily up to ``batch_tokens`` tokens."""
    order = torch.randperm(len(rows), generator=generator).tolist()
    current: list[dict[str, torch.Tensor]] = []
    size = 0
    for i in order:
        n = int(rows[i]["input_ids"].shape[0])
        if current and size + n > batch_tokens:
            yield pack(current)
            current, size = [], 0
        current.append(rows[i])
        size += n
    if current:
        yield pack(current)
