"""What changes the tokenized conversations: the tokenize rule's ``params.settings``.

The model itself is an input of the rule (its config.json) and the tokenizer's and chat
template's hashes go into every shard's attributes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal


def tokenize_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "chat_template_kwargs": config["model"]["chat_template_kwargs"],
        "max_seq_len": config["hidden_states"]["max_seq_len"],
        "reasoning": config["tokenize"]["reasoning"],
    }


@dataclass(frozen=True)
class TokenizeSettings:
    """How responses become samples, parsed once from the rule's params (the keys of
    :func:`tokenize_settings`); the tokenize stage and the validator's re-tokenizing take it."""

    chat_template_kwargs: Mapping[str, Any]
    max_seq_len: int
    reasoning: Literal["keep", "drop"]

    @classmethod
    def parse(cls, params: Mapping[str, Any]) -> TokenizeSettings:
        return cls(
            chat_template_kwargs=dict(params["chat_template_kwargs"]),
            max_seq_len=int(params["max_seq_len"]),
            reasoning=params["reasoning"],
        )

    @classmethod
    def of_config(cls, config: Mapping[str, Any]) -> TokenizeSettings:
        return cls.parse(tokenize_settings(config))

    def render_options(self) -> dict[str, Any]:
        """The renderers' keyword arguments (:func:`.samples.tokenize_response`)."""
        return {
            "chat_template_kwargs": dict(self.chat_template_kwargs),
            "max_seq_len": self.max_seq_len,
            "reasoning": self.reasoning,
        }
