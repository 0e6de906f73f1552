"""EAGLE-3 draft vocabulary: the target tokens the draft's lm_head predicts.

The draft predicts only the ``size`` target tokens that occur most often where the loss
mask is set, over all datasets (EAGLE's ``cnets.py::Model.scandata``; SpecForge's
``specforge/data/preprocessing.py::process_token_dict_to_mappings``). The chosen ids,
sorted ascending as ``used``, give two tensors in SpecForge's convention, saved with
``torch.save({"d2t": d2t, "t2d": t2d})`` (what SpecForge's
``load_vocab_mapping`` and SGLang's EAGLE-3 drafts load):

* ``d2t``: int64 [size], offsets: draft id ``i`` is target id ``i + d2t[i]``;
* ``t2d``: bool [target vocab], True on the target ids in the draft vocabulary; so
  ``t2d.nonzero() == d2t + arange(size)``.

Deterministic where SpecForge is not: ties in frequency go to the lower token id
(SpecForge keeps ``Counter`` insertion order, i.e. corpus order). When fewer distinct
tokens were seen than ``size``, the rest is filled with the lowest unseen ids, as
SpecForge does (count 0, so coverage is unchanged). A ``size`` at or above the target
vocabulary gives the whole target vocabulary (``d2t`` all 0, ``t2d`` all True), like
drafts that keep the full vocabulary; SpecForge itself would pad with ids the target
does not have.

Counts come from ``results/tokenized/{dataset}.parquet``: the same ``input_ids`` and
``loss_mask`` as the shards (already cut at ``max_seq_len``), at a fraction of the bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import torch

from ..atomic import atomic_path, write_json
from ..checks import positive_int
from ..errors import DraftVocabError
from ..model_config import read_model_config, vocab_size

__all__ = ["DraftVocab", "build_draft_vocab", "count_loss_tokens", "draft_vocab"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftVocab:
    """A draft vocabulary and how well it covers the supervised tokens."""

    used: np.ndarray  # int64 [size], ascending target ids
    d2t: torch.Tensor  # int64 [size]
    t2d: torch.Tensor  # bool [target_vocab_size]
    loss_tokens: int  # supervised tokens counted
    covered_tokens: int  # of those, how many are in the draft vocabulary
    distinct_tokens: int  # distinct target ids among the supervised tokens
    padded: int  # ids added with count 0 because fewer distinct tokens were seen

    @property
    def size(self) -> int:
        return int(self.d2t.numel())

    @property
    def coverage(self) -> float | None:
        return self.covered_tokens / self.loss_tokens if self.loss_tokens else None


def count_loss_tokens(tokenized_paths: Sequence[str | Path]) -> dict[int, int]:
    """Occurrences of each token id at loss-masked positions, over all files."""
    paths = [str(p) for p in tokenized_paths]
    if not paths:
        return {}
    counts = (
        pl.scan_parquet(paths)
        .select("input_ids", "loss_mask")
        .explode(["input_ids", "loss_mask"])
        .filter(pl.col("loss_mask") == 1)
        .group_by("input_ids")
        .agg(pl.col("loss_mask").cast(pl.Int64).sum().alias("count"))
        # Streaming: the exploded tokens of a large corpus never sit in memory at once.
        .collect(engine="streaming")
    )
    return dict(zip(counts["input_ids"].to_list(), counts["count"].to_list(), strict=True))


def draft_vocab(counts: Mapping[int, int], size: int, target_vocab: int) -> DraftVocab:
    """The ``size`` most frequent ids of ``counts`` (ties: lower id first) as d2t/t2d."""
    size = positive_int(size, "draft_vocab.size", DraftVocabError)
    target_vocab = positive_int(target_vocab, "target vocabulary size", DraftVocabError)
    size = min(size, target_vocab)  # the draft cannot predict tokens the target lacks
    ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
    freq = np.fromiter(counts.values(), dtype=np.int64, count=len(counts))
    if ids.size and (ids.min() < 0 or ids.max() >= target_vocab):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise DraftVocabError(
            f"token id {bad} is outside the target vocabulary (0..{target_vocab - 1}); "
            f"the tokenizer and the model's vocab_size disagree"
        )
    # Most frequent first, ties to the lower id: lexsort sorts by its last key first.
    order = np.lexsort((ids, -freq))
    chosen = ids[order[:size]]
    covered = int(freq[order[:size]].sum())
    padded = size - chosen.size
    if padded:
        unseen = np.ones(target_vocab, dtype=bool)
        unseen[chosen] = False
        chosen = np.concatenate([chosen, np.flatnonzero(unseen)[:padded]])
    used = np.sort(chosen)
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[torch.from_numpy(used)] = True
    d2t = torch.from_numpy(used - np.arange(size, dtype=np.int64))
    return DraftVocab(
        used=used,
        d2t=d2t,
        t2d=t2d,
        loss_tokens=int(freq.sum()),
        covered_tokens=covered,
        distinct_tokens=int(ids.size),
        padded=int(padded),
    )


def build_draft_vocab(
    *,
    datasets: Sequence[str],
    tokenized_paths: Sequence[str],
    model_path: str,
    size: int,
    out_mapping: str,
    out_summary: str,
) -> None:
    """Count, choose and write ``draft_vocab.pt`` and its JSON summary."""
    counts = count_loss_tokens(tokenized_paths)
    target_vocab = vocab_size(read_model_config(model_path))
    vocab = draft_vocab(counts, size, target_vocab)
    if vocab.size < size:
        log.warning(
            "draft_vocab.size %d exceeds the target vocabulary: using all %d target tokens",
            size,
            target_vocab,
        )
    if not vocab.loss_tokens:
        log.warning("no supervised tokens in any dataset: the draft vocabulary is the lowest ids")
    # Through a file handle: torch.save names its archive after a path, and the
    # temporary's random name would make the bytes differ from run to run.
    with atomic_path(out_mapping) as tmp, open(tmp, "wb") as fh:
        torch.save({"d2t": vocab.d2t, "t2d": vocab.t2d}, fh)
    summary = {
        "size": vocab.size,
        "requested_size": size,
        "target_vocab_size": int(vocab.t2d.numel()),
        "datasets": list(datasets),
        "loss_tokens": vocab.loss_tokens,
        "distinct_loss_tokens": vocab.distinct_tokens,
        "covered_loss_tokens": vocab.covered_tokens,
        "coverage": vocab.coverage,
        "padded_with_unseen_ids": vocab.padded,
        "convention": "target_id = draft_id + d2t[draft_id]; t2d[target_id] = in draft vocab",
        "tie_break": "higher count first, then lower token id",
    }
    write_json(out_summary, summary)
    coverage = "n/a" if vocab.coverage is None else f"{vocab.coverage:.2%}"
    log.info(
        "draft vocabulary: %d of %d target ids cover %s of %d supervised tokens "
        "(%d distinct seen, %d padded)",
        vocab.size,
        vocab.t2d.numel(),
        coverage,
        vocab.loss_tokens,
        vocab.distinct_tokens,
        vocab.padded,
    )
