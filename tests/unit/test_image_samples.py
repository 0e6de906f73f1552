"""Samples of rows with images: an image's run of tokens read as its one placeholder, a
cut at max_seq_len never through an image, and the rows a re-render cannot make."""

from __future__ import annotations

from typing import Any

import pytest

from eagle3data.chat import TokenizedConversation
from eagle3data.images import image_part, text_part
from eagle3data.tokenization.samples import _truncated, collapsed, image_runs, tokenize_response

IMAGE = 9


def test_each_run_of_image_tokens_reads_as_one() -> None:
    ids = [1, IMAGE, IMAGE, IMAGE, 2, IMAGE, IMAGE, 3]
    assert collapsed(ids, IMAGE) == [1, IMAGE, 2, IMAGE, 3]
    assert image_runs(ids, IMAGE) == 2
    assert image_runs(ids, None) == 0
    assert image_runs([IMAGE], IMAGE) == 1 and collapsed([], IMAGE) == []
    # At either end, and without images (the vLLM capture sends these folded ids).
    assert collapsed([1, IMAGE, IMAGE, IMAGE, 2, IMAGE, IMAGE, 3, IMAGE], IMAGE) == [
        1, IMAGE, 2, IMAGE, 3, IMAGE,
    ]  # fmt: skip
    assert collapsed([IMAGE, IMAGE, 1], IMAGE) == [IMAGE, 1]
    assert collapsed([1, 2], IMAGE) == [1, 2]


@pytest.mark.parametrize(
    ("max_seq_len", "kept"),
    [
        (3, [1, 2]),  # inside the image: cut before it
        (5, [1, 2, IMAGE, IMAGE, IMAGE]),  # right after it: whole
        (2, [1, 2]),  # just before it
        (6, [1, 2, IMAGE, IMAGE, IMAGE, 3]),  # after it: kept whole
    ],
)
def test_a_cut_never_splits_an_image(max_seq_len: int, kept: list[int]) -> None:
    ids = [1, 2, IMAGE, IMAGE, IMAGE, 3, 4]
    sample = TokenizedConversation(ids, [0] * 6 + [1], len(ids), None)
    cut = _truncated(sample, max_seq_len, IMAGE)
    assert cut.input_ids == kept and len(cut.loss_mask) == len(kept)
    assert cut.num_tokens_before_truncation == len(ids)


def row(**extra: Any) -> dict[str, Any]:
    parts = [image_part("a" * 64), text_part("What is it?")]
    messages = [{"role": "user", "content": parts}, {"role": "assistant", "content": "A cat."}]
    return {"id": "r", "messages": messages, **extra}


@pytest.mark.parametrize(
    ("response", "reasoning", "image_token", "problem"),
    [
        (row(), "keep", IMAGE, "no token ids from the engine"),
        (row(turns=[{"prompt_token_ids": [1], "completion_token_ids": [2]}]), "drop", IMAGE,
         "reasoning: drop"),
        (row(turns=[{"prompt_token_ids": [1], "completion_token_ids": [2]}]), "keep", None,
         "names no image token"),
    ],
)  # fmt: skip
def test_rows_with_images_a_rerender_cannot_make_are_refused(
    response: dict[str, Any], reasoning: str, image_token: int | None, problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        tokenize_response(
            None,  # type: ignore[arg-type]  # refused before the tokenizer is used
            response,
            chat_template_kwargs={},
            max_seq_len=None,
            reasoning=reasoning,
            image_token=image_token,
        )
