"""What changes the tokenized conversations: the tokenize rule's ``params.settings``.

The model itself is an input of the rule (its config.json) and the tokenizer's and chat
template's hashes go into every shard's attributes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def tokenize_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "chat_template_kwargs": config["model"]["chat_template_kwargs"],
        "max_seq_len": config["hidden_states"]["max_seq_len"],
        "reasoning": config["tokenize"]["reasoning"],
    }
