"""A response row's training samples: from the token ids the engine returned, checked
against the chat template's re-render, or from the re-render where there are no ids.

From the engine's ids
    Each assistant turn ``k`` of a row has the ids the target saw (``prompt``: the
    server's own render and tokenization of the history) and produced (``completion``: up
    to and including the token that ended it: the end-of-turn token for a turn that
    stopped, the token that completed a ``sampling.stop`` string (whose text the content
    leaves out) for one stopped by it; SGLang 0.5.23, vLLM 0.32 and the in-process engine
    all return them so, tests/data/sglang/ and tests/data/vllm/). These are
    exact where a re-render is not: a sampled completion may be a non-canonical
    tokenization of its own text, reasoning parsers strip the reasoning's whitespace, and
    a server's render may differ from ours (null keys, its own tool handling).

    Consecutive turns whose prompt ids extend the previous turn's prompt and completion
    ids make **one sample**: the prompt and completion ids of the last of them, each
    turn's completion supervised. A turn whose prompt ids do not (a **break**: the server
    rendered history otherwise than the target produced it: Qwen3's and Kimi's templates
    drop history reasoning; a stop string, a re-serialized tool call or a non-canonical
    sampled token re-tokenized differently as history) starts a new sample, its prompt
    the server's render of the context. A conversation without breaks is one sample; a
    thinking target that drops history reasoning breaks at every turn, one sample per
    turn; one break in ten turns makes two samples, not ten. The loss mask covers exactly
    the completion ids, never a token the template writes.

    ``tokenize.reasoning: drop`` trains a draft for thinking off on text the target never
    produced that way, so it always takes the re-render.

The comparison
    Each turn with ids is also rendered by the chat template (:func:`..chat.turn_renders`)
    and tokenized: the turn is **identical** when the re-render's ids start with the
    engine's prompt and completion ids (the template may write more after the last
    produced token: a newline after the end-of-turn token, the closing tags of a turn cut
    at ``max_tokens``), and **differs** otherwise, with where: the first differing token
    and both pieces from there, decoded.

Rows written before ids were kept, and turns of a server that returned none, take the
re-render (:func:`..chat.tokenize_conversation`), as they always did.

Images
    The engine's prompt ids hold each image expanded to its tokens (the target's image
    token, once per image patch group), as the target's processor expands it; the
    template's re-render holds one placeholder per image. The comparison therefore reads
    each run of image tokens as one. A row with images needs the engine's ids (a re-render
    cannot know an image's token count without the processor), and a sample cut at
    ``max_seq_len`` is cut before an image it would split: the target sees an image whole
    or not at all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..chat import TokenizedConversation, tokenize_conversation, tokenize_text, turn_renders
from ..images import has_images
from ..turn_ids import turn_token_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Tokens of each side decoded where a turn's ids and its re-render part.
DIFF_WINDOW = 8


@dataclass(frozen=True)
class TurnDifference:
    """Where assistant turn ``turn`` (its message index) of a row parts from the
    re-render: token ``position`` of the turn's prompt + completion ids, in ``part``."""

    turn: int
    position: int
    part: str  # "prompt" or "completion"
    engine: str  # the engine's tokens from ``position`` on, decoded
    rerender: str  # the re-render's, decoded

    def summary(self, sample_id: str) -> dict[str, Any]:
        return {
            "id": sample_id,
            "turn": self.turn,
            "position": self.position,
            "part": self.part,
            "engine": self.engine,
            "rerender": self.rerender,
        }


@dataclass(frozen=True)
class ResponseSamples:
    samples: list[TokenizedConversation]
    source: str  # "engine_ids" or "rerender"
    turns_identical: int = 0  # turns with ids whose re-render matches them
    differences: list[TurnDifference] = field(default_factory=list)


def tokenize_response(
    tokenizer: PreTrainedTokenizerBase,
    response: Mapping[str, Any],
    *,
    chat_template_kwargs: Mapping[str, Any],
    max_seq_len: int | None,
    reasoning: str,
    image_token: int | None = None,
) -> ResponseSamples:
    """The samples of one response row (see the module docstring); ``image_token``: the
    target's image token id (None for a text model)."""
    messages = response["messages"]
    tools = response.get("tools")  # rendered as at generation time
    ids = turn_token_ids(response.get("turns", []))
    without_ids = reasoning == "drop" or not ids or any(i is None for i in ids)
    if has_images(messages):
        _check_image_row(without_ids, reasoning, image_token)
    if without_ids:
        samples = tokenize_conversation(
            tokenizer,
            messages,
            chat_template_kwargs=chat_template_kwargs,
            max_seq_len=max_seq_len,
            reasoning=reasoning,
            tools=tools,
        )
        return ResponseSamples(samples, "rerender")
    renders = turn_renders(
        tokenizer, messages, chat_template_kwargs=chat_template_kwargs, tools=tools
    )
    if len(renders) != len(ids):
        raise ValueError(f"{len(ids)} turns with token ids for {len(renders)} assistant messages")
    engine_turns = [(r.index, *pair) for r, pair in zip(renders, ids, strict=True) if pair]
    identical = 0
    differences = []
    for render, (_, prompt, completion) in zip(renders, engine_turns, strict=True):
        # The template's view of the turn, tokenized as a whole like the old samples.
        text = render.prompt + render.produced
        rerendered, _ = tokenize_text(tokenizer, text, [])
        if image_token is not None:  # an image's run of tokens against its one placeholder
            prompt, completion, rerendered = (
                collapsed(part, image_token) for part in (prompt, completion, rerendered)
            )
        difference = _difference(tokenizer, render.index, prompt, completion, rerendered)
        if difference is None:
            identical += 1
        else:
            differences.append(difference)
    samples = [_truncated(s, max_seq_len, image_token) for s in samples_from_ids(engine_turns)]
    return ResponseSamples(samples, "engine_ids", identical, differences)


def _check_image_row(without_ids: bool, reasoning: str, image_token: int | None) -> None:
    if image_token is None:
        raise ValueError(
            "the row has images, but the target's config.json names no image token "
            "(image_token_id): is the model an image-text one?"
        )
    if reasoning == "drop":
        raise ValueError(
            "tokenize.reasoning: drop re-renders every turn, and a re-render cannot expand "
            "an image to its tokens: rows with images need reasoning: keep"
        )
    if without_ids:
        raise ValueError(
            "the row has images but no token ids from the engine (generation.return_token_ids "
            "true, a server that returns them): a re-render cannot expand an image to its tokens"
        )


def collapsed(ids: Sequence[int], token: int) -> list[int]:
    """``ids`` with each run of ``token`` as one."""
    return [t for k, t in enumerate(ids) if t != token or k == 0 or ids[k - 1] != token]


def image_runs(ids: Sequence[int], token: int | None) -> int:
    """How many images ``ids`` hold (runs of the image token)."""
    if token is None:
        return 0
    return sum(1 for k, t in enumerate(ids) if t == token and (k == 0 or ids[k - 1] != token))


def samples_from_ids(
    turns: Sequence[tuple[int, Sequence[int], Sequence[int]]],
) -> list[TokenizedConversation]:
    """Untruncated samples of (message index, prompt ids, completion ids) per turn: one
    per run of turns that extend each other (see the module docstring); a sample's
    ``turn`` is its first turn's message index, None when it is the whole conversation."""
    runs = _extending_runs(turns)
    if len(runs) == 1:
        return [_run_sample(runs[0], None)]
    return [_run_sample(run, run[0][0]) for run in runs]


def _extending_runs(
    turns: Sequence[tuple[int, Sequence[int], Sequence[int]]],
) -> list[list[tuple[int, Sequence[int], Sequence[int]]]]:
    """The turns cut where a turn's prompt ids do not start with the previous turn's
    prompt and completion ids (a break: the server rendered history otherwise)."""
    runs: list[list[tuple[int, Sequence[int], Sequence[int]]]] = []
    done: list[int] = []
    for turn in turns:
        _, prompt, completion = turn
        if not runs or list(prompt[: len(done)]) != done:
            runs.append([])
        runs[-1].append(turn)
        done = [*prompt, *completion]
    return runs


def _run_sample(
    run: Sequence[tuple[int, Sequence[int], Sequence[int]]], turn: int | None
) -> TokenizedConversation:
    """The last turn's prompt and completion ids, every turn's completion supervised
    (each turn's prompt extends the one before, so its completion sits at its own place)."""
    _, prompt, completion = run[-1]
    ids = [*prompt, *completion]
    mask = [0] * len(ids)
    for _, p, c in run:
        mask[len(p) : len(p) + len(c)] = [1] * len(c)
    return TokenizedConversation(ids, mask, len(ids), turn)


def _truncated(
    sample: TokenizedConversation, max_seq_len: int | None, image_token: int | None = None
) -> TokenizedConversation:
    if max_seq_len is None or len(sample.input_ids) <= max_seq_len:
        return sample
    cut = max_seq_len
    ids = sample.input_ids
    if image_token is not None and ids[cut] == image_token:
        while cut > 0 and ids[cut - 1] == image_token:  # never inside an image: before it
            cut -= 1
    return TokenizedConversation(
        sample.input_ids[:cut],
        sample.loss_mask[:cut],
        sample.num_tokens_before_truncation,
        sample.turn,
    )


def _difference(
    tokenizer: PreTrainedTokenizerBase,
    turn: int,
    prompt: Sequence[int],
    completion: Sequence[int],
    rerendered: Sequence[int],
) -> TurnDifference | None:
    engine = [*prompt, *completion]
    if list(rerendered[: len(engine)]) == engine:
        return None
    position = next(
        (k for k, (a, b) in enumerate(zip(engine, rerendered, strict=False)) if a != b),
        len(rerendered),  # the re-render ends first
    )

    def piece(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids[position : position + DIFF_WINDOW])))

    return TurnDifference(
        turn=turn,
        position=position,
        part="prompt" if position < len(prompt) else "completion",
        engine=piece(engine),
        rerender=piece(rerendered),
    )
