"""Chat rendering and assistant-only loss masks.

Everything that turns a conversation into model input goes through this module, so the
responses we generate, the hidden states we dump and the loss mask the draft model trains
on all come from the same rendered text. What the template is given (the conversation
checked, tools, template variables) is :mod:`.chat_messages`; the tokenizer's and
template's hashes are :mod:`.tokenizer_hashes`.

How the training samples and loss masks are derived
---------------------------------------------------
Chat templates differ too much (headers, BOS, injected think blocks, reasoning that is
dropped from history) to find assistant text by splitting on a marker string. Instead the
template itself tells us what the target saw and what it produced, turn by turn:

1. For assistant turn ``i``, ``P_i = render(messages[:i], add_generation_prompt=True)`` is
   the prompt the target saw when it produced that turn (the engines render exactly
   this), so the generation prompt (``<|im_start|>assistant\\n``, Llama-3's header, the
   ``<think>`` that Kimi-K2.5 opens, the empty ``<think>\\n\\n</think>\\n\\n`` that Qwen3
   injects with ``enable_thinking=False``) is never supervised.
2. ``F_i = render(messages[:i + 1], add_generation_prompt=False)`` renders turn ``i`` as
   the last message and ``X_i = F_i[lcp(F_i, P_i):]`` is the text the template writes for
   that turn's output: reasoning block, content, end-of-turn token, trailing newline.
   Kimi-K2.5 renders even the last turn as history (``<think></think>content``): when the
   reasoning is missing from ``X_i`` and ``X_i`` starts with ``</think>`` (the prompt
   opened the block), the reasoning goes in front of it, which is what the model wrote.
3. ``R = render(messages, add_generation_prompt=False)`` is the whole conversation. Turn
   ``i`` starts at ``start_i = lcp(R, P_i)``; if ``R`` continues there with all of
   ``X_i`` for every turn, the conversation is **one sample**: ``R`` with those spans.
4. Otherwise the template renders history differently from the generation-time view
   (Qwen3 and Kimi-K2.5 drop the reasoning of history turns, so ``R`` lacks what the
   target produced): the conversation becomes **one sample per assistant turn**,
   ``P_i + X_i`` with ``X_i`` supervised, as SpecForge's expand-reasoning script does.
   Each sample is then exactly the target's view when it produced that turn.
5. Each sample is tokenized once by the target's own tokenizer; a token is supervised
   (mask 1) iff its character span overlaps a supervised span. Fast tokenizers give the
   offsets; for slow ones (Kimi's tiktoken) see :func:`tokenize_text`.

``reasoning="drop"`` removes ``reasoning_content`` before all this, for a draft that
serves the target with thinking off; then most conversations are one sample.

Tool calling
------------
Conversations may hold ``tool`` turns (results, prompt: never supervised) and assistant
turns with ``tool_calls`` (produced by the target: reasoning, content and the tool-call
markup the template renders are supervised like any assistant output). ``tools`` (OpenAI
tool specs) reach the template as ``apply_chat_template(tools=...)``. Each call's
``function.arguments`` JSON string is handed to the template as the object it encodes
(Llama-3.1-style templates write ``arguments | tojson``, Qwen3's and Kimi's take either;
SGLang and vLLM do the same with history), or as the string if it encodes no object.

A template may render earlier turns differently once a turn is present (Kimi-K2.5 drops
the reasoning of a tool-call chain from history when the chain's final answer arrives,
while the chain's own turns saw it): then ``F_i`` and ``P_i`` part before turn ``i`` and
``X_i`` is found after the generation prompt's own occurrence in ``F_i`` instead (see
:func:`_turn_output`).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .chat_messages import Message, template_kwargs, template_tools, validated
from .errors import ChatTemplateError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "REASONING_MODES",
    "ChatTemplateError",
    "Message",
    "RenderedSample",
    "TokenizedConversation",
    "TurnRender",
    "opens_reasoning",
    "render",
    "split_reasoning",
    "tokenize_conversation",
    "tokenize_text",
    "training_samples",
    "turn_renders",
]

# Prefixed to a turn's texts to find where the template first writes them (_turn_output).
_MARK = "\x00"

REASONING_MODES = ("keep", "drop")
# The think tags of every thinking family we serve (Kimi-K2.x, Qwen3, DeepSeek-R1).
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class RenderedSample:
    """One training text and the character spans of what the target produced in it."""

    text: str
    spans: list[tuple[int, int]]
    # None: the whole conversation; else the index of the one assistant message trained.
    turn: int | None


@dataclass(frozen=True)
class TokenizedConversation:
    input_ids: list[int]
    # 1 on tokens the draft learns (assistant output incl. its end-of-turn token), else 0.
    loss_mask: list[int]
    num_tokens_before_truncation: int
    # As in RenderedSample: None for the whole conversation, else one assistant turn.
    turn: int | None = None

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
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """Render ``messages`` with the tokenizer's chat template (no tokenization).

    ``chat_template_kwargs`` become extra template variables, e.g.
    ``{"enable_thinking": False}`` for Qwen3 or ``{"thinking": True}`` for Kimi;
    ``tools`` (OpenAI tool specs) go to the template's ``tools``.
    """
    conversation = validated(messages)
    template = _Template(tokenizer, template_kwargs(chat_template_kwargs), template_tools(tools))
    return template.render(conversation, add_generation_prompt)


def training_samples(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    reasoning: str = "keep",
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[RenderedSample]:
    """The texts a conversation is trained as, with the spans the draft learns.

    One sample for the whole conversation when its render holds every assistant turn
    exactly as produced; otherwise one sample per assistant turn (see the module
    docstring). ``reasoning="drop"`` removes ``reasoning_content`` first, for a draft
    that serves the target with thinking off. ``tools`` as in :func:`render`.
    """
    full, turns = _renders(tokenizer, messages, chat_template_kwargs, reasoning, tools)
    spans: list[tuple[int, int]] = []
    whole = True
    for turn in turns:
        start = _common_prefix_len(full, turn.prompt)
        length = _longest_suffix_at(turn.produced, full, start)
        spans.append((start, start + length))
        whole = whole and length == len(turn.produced)
    if whole:
        return [RenderedSample(full, spans, None)]
    return [
        RenderedSample(
            t.prompt + t.produced, [(len(t.prompt), len(t.prompt) + len(t.produced))], t.index
        )
        for t in turns
    ]


@dataclass(frozen=True)
class TurnRender:
    """Assistant turn ``index`` as the template renders it: the prompt the target saw
    (steps 1-2 of the module docstring) and the text it produced after it."""

    index: int
    prompt: str
    produced: str


def turn_renders(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    reasoning: str = "keep",
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[TurnRender]:
    """Every assistant turn's generation-time view, as in :func:`training_samples`."""
    return _renders(tokenizer, messages, chat_template_kwargs, reasoning, tools)[1]


def _renders(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    chat_template_kwargs: Mapping[str, Any] | None,
    reasoning: str,
    tools: Sequence[Mapping[str, Any]] | None,
) -> tuple[str, list[TurnRender]]:
    """The whole conversation's render and each assistant turn's :class:`TurnRender`."""
    if reasoning not in REASONING_MODES:
        raise ValueError(f"reasoning must be one of {list(REASONING_MODES)}, got {reasoning!r}")
    conversation = validated(messages)
    if reasoning == "drop":
        conversation = [
            {k: v for k, v in m.items() if k != "reasoning_content"} for m in conversation
        ]
    template = _Template(tokenizer, template_kwargs(chat_template_kwargs), template_tools(tools))
    turns = []
    for i, message in enumerate(conversation):
        if message["role"] != "assistant":
            continue
        prompt = template.render(conversation[:i], True)
        produced = _with_reasoning(i, message, _turn_output(template, conversation, i, prompt))
        turns.append(TurnRender(i, prompt, produced))
    return template.render(conversation, False), turns


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    max_seq_len: int | None = None,
    reasoning: str = "keep",
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[TokenizedConversation]:
    """Tokenize each training sample of a conversation once and mark what the target
    produced (see :func:`training_samples`)."""
    if max_seq_len is not None and max_seq_len < 1:
        raise ValueError(f"max_seq_len must be a positive integer, got {max_seq_len}")
    out: list[TokenizedConversation] = []
    for sample in training_samples(
        tokenizer,
        messages,
        chat_template_kwargs=chat_template_kwargs,
        reasoning=reasoning,
        tools=tools,
    ):
        input_ids, loss_mask = tokenize_text(tokenizer, sample.text, sample.spans)
        total = len(input_ids)
        if max_seq_len is not None:
            input_ids = input_ids[:max_seq_len]
            loss_mask = loss_mask[:max_seq_len]
        out.append(
            TokenizedConversation(
                input_ids=input_ids,
                loss_mask=loss_mask,
                num_tokens_before_truncation=total,
                turn=sample.turn,
            )
        )
    return out


def tokenize_text(
    tokenizer: PreTrainedTokenizerBase, text: str, spans: Sequence[tuple[int, int]]
) -> tuple[list[int], list[int]]:
    """The tokenizer's own ids for ``text`` and a mask of the tokens inside ``spans``.

    Fast tokenizers give character offsets. Slow ones (Kimi's tiktoken tokenizer) give
    none, so the text is encoded piece by piece between span boundaries; the pieces
    must concatenate to the encoding of the whole text, which proves each token lies
    on one side of every boundary. If a token straddles one, token bytes (tiktoken)
    place it instead; a tokenizer that offers neither stops with an error.
    """
    # The template already wrote BOS and friends; letting the tokenizer add them again
    # would duplicate them and shift every offset.
    if getattr(tokenizer, "is_fast", False):
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(encoding["input_ids"]), _overlap_mask(encoding["offset_mapping"], spans)
    input_ids = _encode(tokenizer, text)
    bounds = sorted({0, len(text), *(b for span in spans for b in span)})
    piece_ids: list[int] = []
    piece_mask: list[int] = []
    for a, b in itertools.pairwise(bounds):
        ids = _encode(tokenizer, text[a:b])
        inside = any(s <= a and b <= e for s, e in spans)
        piece_ids.extend(ids)
        piece_mask.extend([int(inside)] * len(ids))
    if piece_ids == input_ids:
        return input_ids, piece_mask
    offsets = _char_offsets_from_bytes(tokenizer, input_ids, text)
    if offsets is None:
        raise ChatTemplateError(
            f"{type(tokenizer).__name__} gives no character offsets and a token crosses "
            f"the boundary of an assistant turn; the loss mask cannot be derived"
        )
    return input_ids, _overlap_mask(offsets, spans)


def opens_reasoning(prompt: str) -> bool:
    """Whether a rendered generation prompt leaves the model inside a think block
    (Kimi-K2.5 ends it with ``<think>``; ``<think></think>`` is thinking off)."""
    tail = prompt.rstrip()
    return tail.endswith(THINK_OPEN)


def split_reasoning(prompt: str, completion: str) -> tuple[str | None, str]:
    """``(reasoning_content, content)`` of a completion, as the servers' reasoning
    parsers (SGLang ``kimi_k2``, ``qwen3``, ``deepseek-r1``) write them.

    Reasoning runs from the think block's start (in the prompt, or ``<think>`` at the
    completion's start) to ``</think>``; a completion cut off inside it is all
    reasoning. Like the parsers, the reasoning is stripped of surrounding whitespace
    before the split and the content after it. No think block: ``(None, completion)``.
    """
    opened_here = completion.lstrip().startswith(THINK_OPEN)
    if not opens_reasoning(prompt) and not opened_here:
        return None, completion
    text = completion.replace(THINK_OPEN, "", 1) if opened_here else completion
    text = text.strip()
    if THINK_CLOSE not in text:
        return text, ""
    reasoning, content = text.split(THINK_CLOSE, 1)
    return reasoning, content.strip()


@dataclass(frozen=True)
class _Template:
    """The tokenizer's chat template with this conversation's variables and tools."""

    tokenizer: PreTrainedTokenizerBase
    extra: dict[str, Any]
    tools: list[dict[str, Any]] | None

    def render(self, conversation: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                conversation,
                tools=self.tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **self.extra,
            )
        except Exception as exc:  # jinja2 errors, raise_exception() in templates, ...
            raise ChatTemplateError(
                f"chat template failed on {len(conversation)} message(s) "
                f"(add_generation_prompt={add_generation_prompt}): {exc}"
            ) from exc
        if not isinstance(text, str):
            raise ChatTemplateError(f"chat template returned {type(text).__name__}, expected str")
        return text


def _turn_output(
    template: _Template, conversation: list[dict[str, Any]], i: int, prompt: str
) -> str:
    """What the template writes for assistant turn ``i`` after its generation prompt.

    Normally ``F_i`` (the turn rendered last) extends ``prompt`` up to the generation
    prompt and the output is what follows their common prefix. A template may instead
    render the earlier turns differently once turn ``i`` is there (Kimi-K2.5: a finished
    tool-call chain loses its reasoning); then the turn starts after the last occurrence
    of the generation prompt in ``F_i`` before the turn's own texts.
    """
    as_last = template.render(conversation[: i + 1], False)
    start = _common_prefix_len(as_last, prompt)
    if start == len(prompt):
        return as_last[start:]
    history_end = _common_prefix_len(template.render(conversation[:i], False), prompt)
    if start >= history_end:  # they part inside the generation prompt (e.g. a think block)
        return as_last[start:]
    generation_prompt = prompt[history_end:]
    marked = template.render([*conversation[:i], _marked(conversation[i])], False)
    own_texts = _common_prefix_len(as_last, marked)
    at = as_last.rfind(generation_prompt, 0, own_texts) if generation_prompt else -1
    if at == -1:
        raise ChatTemplateError(
            f"turn {i} (assistant): the chat template renders the conversation before this "
            f"turn differently once the turn is present, and the generation prompt "
            f"{generation_prompt[-80:]!r} does not open the turn; its output cannot be placed"
        )
    return as_last[at + len(generation_prompt) :]


def _marked(message: Mapping[str, Any]) -> dict[str, Any]:
    """The message with its texts prefixed by a mark, to see where a render first differs."""
    marked = dict(message)
    marked["content"] = _MARK + message["content"]
    if message.get("reasoning_content"):
        marked["reasoning_content"] = _MARK + message["reasoning_content"]
    return marked


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


def _with_reasoning(i: int, message: Mapping[str, Any], produced: str) -> str:
    """The turn's output as the target produced it, reasoning included.

    Kimi-K2.5 renders even the last assistant turn as history (``<think></think>``),
    so its reasoning is missing from ``produced``; the prompt opened the think block,
    so what the model wrote is the reasoning followed by the rendered ``</think>...``.
    """
    reasoning = message.get("reasoning_content")
    if not reasoning or reasoning.strip() in produced:
        return produced
    if produced.startswith(THINK_CLOSE):
        return reasoning + produced
    raise ChatTemplateError(
        f"turn {i} (assistant): has reasoning_content, but the chat template renders "
        f"none of it and opens no think block for it (renders {produced[:80]!r}); "
        f"set tokenize.reasoning: drop to train on the answers only"
    )


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _char_offsets_from_bytes(
    tokenizer: PreTrainedTokenizerBase, input_ids: Sequence[int], text: str
) -> list[tuple[int, int]] | None:
    """Character ``(start, end)`` of each token from its bytes, for tiktoken-backed
    tokenizers (``tokenizer.model.decode_single_token_bytes``); None if unavailable or
    if the bytes do not spell ``text``. A token ending inside a multi-byte character
    counts as covering that character."""
    token_bytes = getattr(getattr(tokenizer, "model", None), "decode_single_token_bytes", None)
    if token_bytes is None:
        return None
    pieces = [token_bytes(i) for i in input_ids]
    if b"".join(pieces) != text.encode("utf-8"):
        return None
    # char_starts[k] = byte offset of character k (plus the end).
    char_starts = list(itertools.accumulate((len(c.encode("utf-8")) for c in text), initial=0))
    offsets: list[tuple[int, int]] = []
    position = 0
    for piece in pieces:
        end = position + len(piece)
        first = bisect.bisect_right(char_starts, position) - 1
        last = bisect.bisect_left(char_starts, end)
        offsets.append((first, max(first, last)))
        position = end
    return offsets
