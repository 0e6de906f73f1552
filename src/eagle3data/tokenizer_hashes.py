"""Content hashes of the target's tokenizer and of its chat template, stable across
processes: what the tokenize stage's output depends on, recorded with it and in the shards.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from .errors import ChatTemplateError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["chat_template_hash", "tokenizer_hash"]

# Runtime state that transformers toggles on the backend between calls; not part of
# what the tokenizer *is*, so it must not change its hash.
_VOLATILE_BACKEND_KEYS = ("truncation", "padding")


def chat_template_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    """SHA-256 hex digest of the chat template text that :func:`.chat.render` uses."""
    return _sha256(_template_text(tokenizer))


def tokenizer_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    """SHA-256 hex digest of a canonical dump of the tokenizer, stable across processes.

    Covers the backend (normalizer, pre-tokenizer, model, added tokens, post-processor,
    decoder) and the special-token map; it deliberately ignores the Python class name,
    the chat template (see ``chat_template_hash``) and truncation/padding state.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        dump = json.loads(backend.to_str())
        for key in _VOLATILE_BACKEND_KEYS:
            dump.pop(key, None)
        canonical: dict[str, Any] = {"backend": dump}
    else:
        # Slow tokenizers have no single serialisable state; the vocabulary is the best
        # portable proxy we have.
        canonical = {"vocab": tokenizer.get_vocab()}
    canonical["special_tokens"] = tokenizer.special_tokens_map
    return _sha256(json.dumps(canonical, sort_keys=True, ensure_ascii=False, default=str))


def _template_text(tokenizer: PreTrainedTokenizerBase) -> str:
    try:
        template = tokenizer.get_chat_template()
    except ValueError as exc:
        raise ChatTemplateError(f"tokenizer has no usable chat template: {exc}") from exc
    return template


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
