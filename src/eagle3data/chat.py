"""Chat rendering and assistant-only loss masks.

Everything that turns a conversation into model input goes through this module, so the
responses we generate, the hidden states we dump and the loss mask the draft model trains
on all come from the same rendered text.

How the loss mask is derived
----------------------------
Chat templates differ too much (headers, BOS, injected think blocks, reasoning that is
dropped from history) to find assistant text by splitting on a marker string. Instead the
template itself tells us where each assistant turn starts and ends:

1. ``R = render(messages, add_generation_prompt=False)`` is the text we tokenize.
2. For assistant turn ``i``, ``P_i = render(messages[:i], add_generation_prompt=True)`` is
   the prompt the model saw when it produced that turn. The turn starts at
   ``start_i = lcp(R, P_i)`` (longest common prefix, at most ``len(P_i)``), so the
   generation prompt (``<|im_start|>assistant\\n``, Llama-3's header, the empty
   ``<think>\\n\\n</think>\\n\\n`` that Qwen3 injects when ``enable_thinking=False``) is
   not supervised, while everything the model produced after it is.
3. ``F_i = render(messages[:i + 1], add_generation_prompt=False)`` renders turn ``i`` as
   the last message and ``X_i = F_i[lcp(F_i, P_i):]`` is the text the template writes for
   that turn's output: reasoning block, content, end-of-turn token, trailing newline.
   Usually ``R`` continues with exactly ``X_i`` at ``start_i``. Templates such as Qwen3's
   render history turns differently (they drop ``<think>...</think>`` of assistant turns
   before the last user message), so we use the longest suffix ``s`` of ``X_i`` with
   ``R[start_i:].startswith(s)``; the span is ``[start_i, start_i + len(s))``. If no
   non-empty suffix matches, the spans cannot be derived and ``ChatTemplateError`` names
   the turn.
4. ``R`` is tokenized once with offsets; a token is supervised (mask 1) iff its character
   span overlaps an assistant span: ``token_end > start and token_start < end``.

The mask therefore covers exactly what the template renders for an assistant turn after
its generation prompt, e.g. ``"Paris is the capital.<|im_end|>\\n"`` for ChatML.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import ChatTemplateError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "ChatTemplateError",
    "Message",
    "TokenizedConversation",
    "assistant_char_spans",
    "chat_template_hash",
    "render",
    "tokenize_conversation",
    "tokenizer_hash",
]

Message = Mapping[str, Any]

_ROLES = frozenset({"system", "user", "assistant"})

# Names that ``apply_chat_template`` consumes itself: as template variables they would
# clash with our own arguments or be silently swallowed instead of reaching the template.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "sanitize_control_tokens",
    }
)

# Runtime state that transformers toggles on the backend between calls; not part of
# what the tokenizer *is*, so it must not change its hash.
_VOLATILE_BACKEND_KEYS = ("truncation", "padding")


@dataclass(frozen=True)
class TokenizedConversation:
    input_ids: list[int]
    # 1 on tokens the draft learns (assistant output incl. its end-of-turn token), else 0.
    loss_mask: list[int]
    num_tokens_before_truncation: int

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.loss_mask):
            raise ValueError(
                f"input_ids and loss_mask differ in length "
                f"({len(self.input_ids)} != {len(self.loss_mask)})"
            )

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


def render(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """Render ``messages`` with the tokenizer's chat template (no tokenization).

    ``chat_template_kwargs`` become extra template variables, e.g.
    ``{"enable_thinking": False}`` for Qwen3 or ``{"thinking": True}`` for Kimi.
    """
    conversation = _validated(messages)
    extra = _template_kwargs(chat_template_kwargs)
    return _render(tokenizer, conversation, add_generation_prompt, extra)


def assistant_char_spans(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """Return the full render and one ``(start, end)`` character span per assistant turn.

    See the module docstring for how the spans are derived.
    """
    conversation = _validated(messages)
    extra = _template_kwargs(chat_template_kwargs)
    full = _render(tokenizer, conversation, False, extra)

    spans: list[tuple[int, int]] = []
    for i, message in enumerate(conversation):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, conversation[:i], True, extra)
        start = _common_prefix_len(full, prompt)

        as_last = _render(tokenizer, conversation[: i + 1], False, extra)
        output = as_last[_common_prefix_len(as_last, prompt) :]

        length = _longest_suffix_at(output, full, start)
        if length == 0:
            raise ChatTemplateError(
                f"turn {i} (assistant): cannot locate its rendered output in the full "
                f"conversation; the template renders it as {output[:80]!r} when it is the "
                f"last turn, but the full render continues with {full[start : start + 80]!r}"
            )
        spans.append((start, start + length))
    return full, spans


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    max_seq_len: int | None = None,
) -> TokenizedConversation:
    """Tokenize a conversation once and mark the tokens of every assistant turn."""
    if max_seq_len is not None and max_seq_len < 1:
        raise ValueError(f"max_seq_len must be a positive integer, got {max_seq_len}")
    if not getattr(tokenizer, "is_fast", False):
        # Offsets are what tie tokens back to the character spans.
        raise TypeError(
            f"{type(tokenizer).__name__} is not a fast tokenizer; the loss mask needs "
            "return_offsets_mapping, which only tokenizers-backed (fast) tokenizers provide"
        )

    text, spans = assistant_char_spans(
        tokenizer, messages, chat_template_kwargs=chat_template_kwargs
    )
    # The template already wrote BOS and friends; letting the tokenizer add them again
    # would duplicate them and shift every offset.
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoding["input_ids"])
    loss_mask = _overlap_mask(encoding["offset_mapping"], spans)

    total = len(input_ids)
    if max_seq_len is not None:
        input_ids = input_ids[:max_seq_len]
        loss_mask = loss_mask[:max_seq_len]
    return TokenizedConversation(
        input_ids=input_ids, loss_mask=loss_mask, num_tokens_before_truncation=total
    )


def chat_template_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    """SHA-256 hex digest of the chat template text that ``render`` uses."""
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


def _render(
    tokenizer: PreTrainedTokenizerBase,
    conversation: list[dict[str, Any]],
    add_generation_prompt: bool,
    extra: dict[str, Any],
) -> str:
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **extra,
        )
    except Exception as exc:  # jinja2 errors, raise_exception() in templates, ...
        raise ChatTemplateError(
            f"chat template failed on {len(conversation)} message(s) "
            f"(add_generation_prompt={add_generation_prompt}): {exc}"
        ) from exc
    if not isinstance(text, str):
        raise ChatTemplateError(f"chat template returned {type(text).__name__}, expected str")
    return text


def _validated(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Check roles and order; return plain dicts for ``apply_chat_template``."""
    if isinstance(messages, (str, bytes)) or not messages:
        raise ChatTemplateError("a conversation needs at least one message")

    conversation: list[dict[str, Any]] = []
    expected = "user"  # role of the next non-system message
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"turn {i}: expected a mapping, got {type(message).__name__}")
        role = message.get("role")
        if role not in _ROLES:
            raise ChatTemplateError(f"turn {i}: role must be one of {sorted(_ROLES)}, got {role!r}")
        if not isinstance(message.get("content"), str):
            raise ChatTemplateError(
                f"turn {i} ({role}): content must be a string, "
                f"got {type(message.get('content')).__name__}"
            )
        reasoning = message.get("reasoning_content")
        if reasoning is not None and (role != "assistant" or not isinstance(reasoning, str)):
            raise ChatTemplateError(
                f"turn {i} ({role}): reasoning_content must be a string on an assistant turn"
            )
        if role == "system":
            if i != 0:
                raise ChatTemplateError(f"turn {i}: a system message is only allowed first")
        elif role != expected:
            raise ChatTemplateError(
                f"turn {i}: expected a {expected} message, got {role} "
                "(conversations start with system or user and then alternate)"
            )
        else:
            expected = "assistant" if role == "user" else "user"
        conversation.append(dict(message))
    return conversation


def _template_kwargs(chat_template_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    extra = dict(chat_template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(extra))
    if reserved:
        raise ValueError(
            f"chat_template_kwargs may not set {reserved}; they are not template variables"
        )
    return extra


def _common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix, compared in C-speed slices."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n  # the common case: one string extends the other
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _longest_suffix_at(suffix_of: str, text: str, start: int) -> int:
    """Length of the longest suffix of ``suffix_of`` that ``text[start:]`` starts with."""
    if start >= len(text):
        return 0
    first = text[start]
    # A match must begin with text[start], so only those positions are candidates;
    # scanning left to right finds the longest one first.
    j = suffix_of.find(first)
    while j != -1:
        if text.startswith(suffix_of[j:], start):
            return len(suffix_of) - j
        j = suffix_of.find(first, j + 1)
    return 0


def _overlap_mask(
    offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
) -> list[int]:
    """1 for each token whose character range overlaps a span; spans are sorted, disjoint."""
    mask = [0] * len(offsets)
    k = 0
    for t, (token_start, token_end) in enumerate(offsets):
        # Offsets are non-decreasing, so spans that end before this token never match again.
        while k < len(spans) and spans[k][1] <= token_start:
            k += 1
        if k == len(spans):
            break
        span_start, span_end = spans[k]
        if token_end > span_start and token_start < span_end:
            mask[t] = 1
    return mask


def _template_text(tokenizer: PreTrainedTokenizerBase) -> str:
    try:
        template = tokenizer.get_chat_template()
    except ValueError as exc:
        raise ChatTemplateError(f"tokenizer has no usable chat template: {exc}") from exc
    return template


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
