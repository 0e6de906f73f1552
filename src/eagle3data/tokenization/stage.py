"""The tokenize stage: each response becomes the training samples it makes (the whole
conversation, or a new sample from each turn whose history was rendered otherwise than
the target produced it), built from the token ids the engine returned, checked against the
chat template's re-render (:mod:`.samples`), or, for rows without ids, rendered with the
target's chat template and tokenized once with its own tokenizer (:mod:`..chat`); what the
target produced is marked; samples left with nothing to learn are dropped and recorded.
A response's ``tools`` are rendered with it, as when it was generated; its tool results
are prompt, its tool calls supervised.

The stats say how the samples were made (``token_ids``): turns built from the engine's
ids and from the re-render, and of the former how many the re-render reproduces, how
many it does not, and where for the first few."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from ..atomic import write_json
from ..errors import ChatTemplateError, ResponseError
from ..images import message_images
from ..model_config import image_token_id, read_model_config
from .samples import ResponseSamples
from .settings import TokenizeSettings
from .table import SCHEMA, sample_id_of, write_tokenized

log = logging.getLogger(__name__)


def tokenize(
    *,
    dataset: str,
    responses_path: str,
    model_path: str,
    settings: TokenizeSettings,
    trust_remote_code: bool,
    out_tokenized: str,
    out_stats: str,
) -> None:
    from ..target import load_tokenizer
    from ..tokenizer_hashes import chat_template_hash, tokenizer_hash
    from .samples import image_runs, tokenize_response

    tokenizer = load_tokenizer(model_path, trust_remote_code=trust_remote_code)
    image_token = image_token_id(read_model_config(model_path))
    rows: dict[str, list[Any]] = {k: [] for k in SCHEMA}
    dropped = []
    n_in = 0
    per_turn = 0
    ids = _IdStats()
    with open(responses_path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            n_in += 1
            resp = json.loads(line)
            try:
                made = tokenize_response(
                    tokenizer,
                    resp,
                    **settings.render_options(),
                    image_token=image_token,
                )
            except (ValueError, ChatTemplateError) as exc:
                raise ResponseError(
                    f"{responses_path}:{line_no} (id {resp.get('id')!r}): {exc}"
                ) from exc
            samples = made.samples
            images = message_images(resp["messages"])
            ids.add(resp, made)
            per_turn += len(samples) > 1
            for tok in samples:
                sample_id = sample_id_of(resp["id"], tok.turn, len(samples))
                if tok.num_loss_tokens == 0:
                    # Nothing for the draft to learn (e.g. the answer was truncated
                    # away by max_seq_len); recorded, never silently lost.
                    dropped.append(
                        {
                            "id": sample_id,
                            "index": resp["index"],
                            "reason": "no assistant token within "
                            f"max_seq_len={settings.max_seq_len} "
                            f"(sample has {tok.num_tokens_before_truncation} tokens)",
                        }
                    )
                    continue
                rows["index"].append(resp["index"])
                rows["id"].append(sample_id)
                rows["turn"].append(tok.turn)
                rows["input_ids"].append(tok.input_ids)
                rows["loss_mask"].append(tok.loss_mask)
                rows["num_tokens"].append(len(tok.input_ids))
                rows["truncated"].append(tok.num_tokens_before_truncation > len(tok.input_ids))
                # A sample holds its conversation's first images (a later turn's render
                # holds every image before it; a cut leaves an image out whole).
                rows["images"].append(images[: image_runs(tok.input_ids, image_token)])
    df = write_tokenized(out_tokenized, rows)
    stats = {
        "dataset": dataset,
        "conversations_in": n_in,
        "conversations_out": df["index"].n_unique(),
        "samples_out": df.height,
        "dropped": dropped,
        "tokens": int(df["num_tokens"].sum() or 0),
        "loss_tokens": int(df["loss_mask"].list.sum().sum() or 0),
        "truncated": int(df["truncated"].sum() or 0),
        "samples_with_images": int((df["images"].list.len() > 0).sum()),
        "max_seq_len": settings.max_seq_len,
        "reasoning": settings.reasoning,
        # Conversations trained as more than one sample: split at the turns whose history
        # differs from what the target produced before (.samples, chat module docstring).
        "conversations_split_per_turn": per_turn,
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "chat_template_hash": chat_template_hash(tokenizer),
        "token_ids": ids.summary(),
    }
    write_json(out_stats, stats)
    log.info(
        "%s: %d samples, %d tokens (%d supervised), %d truncated, %d dropped",
        dataset,
        stats["samples_out"],
        stats["tokens"],
        stats["loss_tokens"],
        stats["truncated"],
        len(dropped),
    )
    summary = stats["token_ids"]
    if summary["turns_from_engine_ids"]:
        log.info(
            "%s: %d turn(s) from the engine's token ids, %d of them re-rendered identically, "
            "%d differently%s; %d turn(s) from the re-render alone",
            dataset,
            summary["turns_from_engine_ids"],
            summary["identical_to_rerender"],
            summary["differ_from_rerender"],
            "".join(f"\n  {_where(d)}" for d in summary["differences"]),
            summary["turns_from_rerender"],
        )


def _where(difference: Mapping[str, Any]) -> str:
    return (
        f"{difference['id']} turn {difference['turn']}: token {difference['position']} "
        f"({difference['part']}): engine {difference['engine']!r}, re-render "
        f"{difference['rerender']!r}"
    )


class _IdStats:
    """The ``token_ids`` section of the stats (module docstring)."""

    def __init__(self, examples: int = 5) -> None:
        self.examples = examples
        self.from_ids = self.from_rerender = self.identical = self.differ = 0
        self.split_by_ids = 0
        self.differences: list[dict[str, Any]] = []

    def add(self, response: Mapping[str, Any], made: ResponseSamples) -> None:
        turns = sum(1 for m in response["messages"] if m["role"] == "assistant")
        if made.source == "rerender":
            self.from_rerender += turns
            return
        self.from_ids += turns
        self.identical += made.turns_identical
        self.differ += len(made.differences)
        self.split_by_ids += len(made.samples) > 1
        for d in made.differences[: max(self.examples - len(self.differences), 0)]:
            self.differences.append(d.summary(response["id"]))

    def summary(self) -> dict[str, Any]:
        return {
            "turns_from_engine_ids": self.from_ids,
            "turns_from_rerender": self.from_rerender,
            "identical_to_rerender": self.identical,
            "differ_from_rerender": self.differ,
            "differences": self.differences,  # the first few
        }
