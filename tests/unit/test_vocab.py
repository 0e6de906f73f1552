"""Draft vocabulary (d2t/t2d) in SpecForge's convention, from loss-masked token counts."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import polars as pl
import pytest
import torch
from specforge.core.compact_teacher import validate_vocab_mapping_consistency
from support.oracles import reference_ids

from eagle3data.consumers.vocab import (
    DraftVocabError,
    build_draft_vocab,
    count_loss_tokens,
    draft_vocab,
)


def write_tokenized(path: Path, rows: list[tuple[list[int], list[int]]]) -> Path:
    """A file with the tokenize stage's schema."""
    pl.DataFrame(
        {
            "id": [f"c{i}" for i in range(len(rows))],
            "input_ids": [ids for ids, _ in rows],
            "loss_mask": [mask for _, mask in rows],
        },
        schema={"id": pl.String, "input_ids": pl.List(pl.Int32), "loss_mask": pl.List(pl.UInt8)},
    ).write_parquet(path)
    return path


def test_hand_computed_example(tmp_path: Path) -> None:
    # Loss-masked tokens: 7 x3, 2 x2, 9 x2, 4 x1; token 5 appears only unmasked.
    a = write_tokenized(tmp_path / "A.parquet", [([5, 7, 7, 2], [0, 1, 1, 1]), ([5, 9], [0, 1])])
    b = write_tokenized(tmp_path / "B.parquet", [([7, 2, 4, 9, 5], [1, 1, 1, 1, 0])])
    counts = count_loss_tokens([a, b])
    assert counts == {7: 3, 2: 2, 9: 2, 4: 1}

    vocab = draft_vocab(counts, size=3, target_vocab=12)
    # Top 3: 7 (3), then the 2-2 tie between 2 and 9 both fit; 4 is out.
    assert vocab.used.tolist() == [2, 7, 9]
    assert vocab.d2t.tolist() == [2 - 0, 7 - 1, 9 - 2]
    assert vocab.d2t.dtype == torch.int64 and vocab.t2d.dtype == torch.bool
    assert vocab.t2d.shape == (12,)
    assert vocab.t2d.nonzero().flatten().tolist() == [2, 7, 9]
    assert (vocab.loss_tokens, vocab.covered_tokens, vocab.distinct_tokens) == (8, 7, 4)
    assert vocab.coverage == 7 / 8 and vocab.padded == 0
    validate_vocab_mapping_consistency(vocab.t2d, vocab.d2t)
    # Draft id -> target id, as the drafter maps its argmax back.
    draft_ids = torch.arange(3)
    assert (draft_ids + vocab.d2t[draft_ids]).tolist() == [2, 7, 9]


def test_ties_go_to_the_lower_id_whatever_the_order() -> None:
    counts = {30: 5, 11: 2, 40: 2, 3: 2, 8: 1}
    expected = [3, 11, 30]  # 30 by count, then the lowest ids of the 2-way tie
    assert draft_vocab(counts, size=3, target_vocab=64).used.tolist() == expected
    reordered = dict(reversed(list(counts.items())))
    assert draft_vocab(reordered, size=3, target_vocab=64).used.tolist() == expected


def test_fewer_distinct_tokens_than_size_pads_with_the_lowest_unseen_ids() -> None:
    vocab = draft_vocab({5: 4, 1: 2}, size=5, target_vocab=10)
    assert vocab.used.tolist() == [0, 1, 2, 3, 5]  # SpecForge fills from range(size) too
    assert vocab.padded == 3 and vocab.coverage == 1.0
    assert int(vocab.t2d.sum()) == 5
    validate_vocab_mapping_consistency(vocab.t2d, vocab.d2t)


def test_no_supervised_tokens_gives_the_lowest_ids() -> None:
    vocab = draft_vocab({}, size=4, target_vocab=10)
    assert vocab.used.tolist() == [0, 1, 2, 3]
    assert vocab.d2t.tolist() == [0, 0, 0, 0]
    assert vocab.coverage is None


@pytest.mark.parametrize("size", [6, 7, 32000])
def test_a_size_from_the_target_vocab_up_gives_the_whole_vocab(size: int) -> None:
    vocab = draft_vocab({2: 1}, size=size, target_vocab=6)
    assert vocab.size == 6
    assert vocab.d2t.tolist() == [0] * 6 and bool(vocab.t2d.all())


@pytest.mark.parametrize(
    ("counts", "size", "target", "message"),
    [
        ({12: 1}, 2, 10, r"token id 12 is outside the target vocabulary \(0..9\)"),
        ({1: 1}, 0, 10, "draft_vocab.size must be a positive integer"),
    ],
)
def test_impossible_requests_are_clear_errors(counts, size, target, message) -> None:
    with pytest.raises(DraftVocabError, match=message):
        draft_vocab(counts, size=size, target_vocab=target)


def test_random_counts_agree_with_a_plain_sort() -> None:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 500, (5000,), generator=gen).tolist()
    counts = Counter(ids)
    vocab = draft_vocab(counts, size=100, target_vocab=500)
    want = reference_ids(counts, 100, 500)
    assert vocab.used.tolist() == want
    assert int(vocab.t2d.sum()) == 100
    validate_vocab_mapping_consistency(vocab.t2d, vocab.d2t)
    assert vocab.covered_tokens == sum(counts[t] for t in want)


def test_build_writes_mapping_and_summary(tmp_path: Path) -> None:
    a = write_tokenized(tmp_path / "A.parquet", [([3, 3, 1, 2], [1, 1, 1, 1])])
    empty = write_tokenized(tmp_path / "B.parquet", [])
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 8}))
    out = tmp_path / "vocab"
    kwargs = {
        "datasets": ["A", "B"],
        "tokenized_paths": [str(a), str(empty)],
        "model_path": str(model),
        "size": 2,
        "out_mapping": str(out / "draft_vocab.pt"),
        "out_summary": str(out / "draft_vocab.json"),
    }
    build_draft_vocab(**kwargs)
    mapping = torch.load(out / "draft_vocab.pt", weights_only=True)
    assert set(mapping) == {"d2t", "t2d"}
    assert mapping["d2t"].tolist() == [1, 2]  # ids 3 (twice) and 1 (wins the tie with 2)
    assert mapping["t2d"].tolist() == [False, True, False, True, False, False, False, False]
    summary = json.loads((out / "draft_vocab.json").read_text())
    assert summary["size"] == 2 and summary["target_vocab_size"] == 8
    assert summary["loss_tokens"] == 4 and summary["covered_loss_tokens"] == 3
    assert summary["coverage"] == pytest.approx(3 / 4)
    assert summary["datasets"] == ["A", "B"]
    first = (out / "draft_vocab.pt").read_bytes()
    build_draft_vocab(**kwargs)
    assert (out / "draft_vocab.pt").read_bytes() == first, "same inputs, same bytes"
    assert sorted(p.name for p in out.iterdir()) == ["draft_vocab.json", "draft_vocab.pt"]

    build_draft_vocab(**{**kwargs, "size": 32000})  # more than the model's 8 tokens
    summary = json.loads((out / "draft_vocab.json").read_text())
    assert (summary["size"], summary["requested_size"], summary["coverage"]) == (8, 32000, 1.0)
    assert torch.load(out / "draft_vocab.pt", weights_only=True)["t2d"].all()
