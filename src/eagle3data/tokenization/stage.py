"""The tokenize stage: render each response with the target's chat template as the
training samples it makes (the whole conversation, or one per assistant turn when the
template drops history reasoning; see :mod:`..chat`), tokenize each once with the
target's own tokenizer and mark what the target produced; samples left with nothing to
learn are dropped and recorded. A response's ``tools`` are rendered with it, as when it
was generated; its tool results are prompt, its tool calls supervised."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from ..atomic import write_json
from .table import SCHEMA, sample_id_of, write_tokenized

log = logging.getLogger(__name__)


def tokenize(
    *,
    dataset: str,
    responses_path: str,
    model_path: str,
    chat_template_kwargs: Mapping[str, Any],
    max_seq_len: int,
    reasoning: str,
    trust_remote_code: bool,
    out_tokenized: str,
    out_stats: str,
) -> None:
    from ..chat import chat_template_hash, tokenize_conversation, tokenizer_hash
    from ..target import load_tokenizer

    tokenizer = load_tokenizer(model_path, trust_remote_code=trust_remote_code)
    rows: dict[str, list[Any]] = {k: [] for k in SCHEMA}
    dropped = []
    n_in = 0
    per_turn = 0
    with open(responses_path, encoding="utf-8") as fh:
        for line in fh:
            n_in += 1
            resp = json.loads(line)
            samples = tokenize_conversation(
                tokenizer,
                resp["messages"],
                chat_template_kwargs=chat_template_kwargs,
                max_seq_len=max_seq_len,
                reasoning=reasoning,
                tools=resp.get("tools"),  # rendered as at generation time
            )
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
                            "reason": f"no assistant token within max_seq_len={max_seq_len} "
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
        "max_seq_len": max_seq_len,
        "reasoning": reasoning,
        # Conversations trained as one sample per assistant turn (module docstring of chat).
        "conversations_split_per_turn": per_turn,
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "chat_template_hash": chat_template_hash(tokenizer),
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
