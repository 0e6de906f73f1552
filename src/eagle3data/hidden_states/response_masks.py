"""The shards' loss masks checked against the response rows themselves.

The re-tokenization check makes samples again with the code that made them, so a
mask-placement bug in that code passes it. This check reads only the row and the shards:

* A row with the engine's token ids (every turn, ``tokenize.reasoning: keep``): each
  sample is as long as the ids of the last turn it trains (or ``max_seq_len``), its
  supervised tokens are exactly the completion ids the row stores for the turns the
  sample trains, in order (those inside ``max_seq_len`` when the sample was cut), and
  each turn's completion ids decode to the turn's reasoning and content, in that order
  (whitespace aside: reasoning parsers strip it).
* A row without ids (re-rendered, and every row under ``tokenize.reasoning: drop``): each
  trained turn's supervised tokens are exactly the smallest run of tokens whose text holds
  the turn's output as the chat template writes it after the turn's own generation prompt
  (``render(messages[:i + 1])`` past ``render(messages[:i], add_generation_prompt=True)``:
  reasoning block, content, tool-call markup, end-of-turn token; a template that renders
  the reasoning of none, as Kimi-K2.5's last turn, gets it in front of its ``</think>``).
  Dropping either end token of a run must lose part of that text, so a mask one token
  too wide (the header's last token, the next turn's first) fails. Whitespace: exact where
  the tokenizer gives back what it encoded (byte-level BPE, tiktoken); otherwise compared
  without whitespace, and an end token that decodes to whitespace only is not judged.
  This derivation is written here again, apart from :mod:`eagle3data.chat`'s (which also
  handles templates that re-render history, for which this check falls back to finding
  the turn's reasoning and content in order), so a bug in that code fails here.

Which turns a sample trains comes from the ids (tokenization.table): the whole
conversation's sample all of them; ``{id}#{i}`` those from message index ``i`` up to the
next sample of the response (stored or recorded as dropped).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..shards import open_shard
from ..turn_ids import turn_token_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Tokens of each side decoded where the supervised tokens and the row part.
_SHOWN = 8
# Characters of a turn's text shown when a decode does not hold it.
_SHOWN_CHARS = 60


@dataclass(frozen=True)
class SampledResponse:
    """One response row of the validator's seeded sample, and where it is."""

    row: Mapping[str, Any]
    origin: str  # "{responses file}:{line}"


@dataclass(frozen=True)
class _StoredSample:
    where: str  # "{shard} sample '{id}' ({origin})"
    first_turn: int | None  # message index the sample starts at; None: the whole conversation
    input_ids: list[int]
    loss_mask: list[int]


def response_mask_errors(
    tokenizer: PreTrainedTokenizerBase,
    responses: Sequence[SampledResponse],
    shard_paths: Sequence[str],
    *,
    max_seq_len: int | None,
    reasoning: str,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    dropped_ids: Collection[str] = (),
) -> list[str]:
    """One line per sample of ``responses`` whose supervised tokens are not what its row
    says the target produced (module docstring)."""
    owners = _sample_owners(responses)
    stored = _stored_samples(shard_paths, owners)
    errors: list[str] = []
    for k, response in enumerate(responses):
        dropped = {owners[d][1] for d in dropped_ids if d in owners and owners[d][0] == k}
        firsts = {sample.first_turn for sample in stored[k]} | dropped
        starts = sorted(first for first in firsts if first is not None)
        errors += _row_errors(
            tokenizer,
            response,
            stored[k],
            starts,
            max_seq_len,
            reasoning,
            dict(chat_template_kwargs or {}),
        )
    return errors


def _assistant_turns(row: Mapping[str, Any]) -> list[int]:
    return [i for i, m in enumerate(row["messages"]) if m.get("role") == "assistant"]


def _sample_owners(responses: Sequence[SampledResponse]) -> dict[str, tuple[int, int | None]]:
    """Every sample id a response can have -> (its position in ``responses``, first turn)."""
    owners: dict[str, tuple[int, int | None]] = {}
    for k, response in enumerate(responses):
        response_id = response.row["id"]
        owners[response_id] = (k, None)
        for i in _assistant_turns(response.row):
            owners[f"{response_id}#{i}"] = (k, i)
    return owners


def _stored_samples(
    shard_paths: Sequence[str], owners: Mapping[str, tuple[int, int | None]]
) -> dict[int, list[_StoredSample]]:
    found: dict[int, list[_StoredSample]] = {k: [] for k, _ in owners.values()}
    for path in shard_paths:
        with open_shard(path) as shard:
            for i, sample_id in enumerate(shard.sample_ids):
                if sample_id not in owners:
                    continue
                k, first_turn = owners[sample_id]
                rows = slice(int(shard.sample_offsets[i]), int(shard.sample_offsets[i + 1]))
                found[k].append(
                    _StoredSample(
                        f"{path} sample {sample_id!r}",
                        first_turn,
                        [int(t) for t in shard.input_ids[rows].tolist()],
                        [int(m) for m in shard.loss_mask[rows].tolist()],
                    )
                )
    return found


def _trained_turns(sample: _StoredSample, turns: Sequence[int], starts: Sequence[int]) -> list[int]:
    """The message indices of the assistant turns ``sample`` trains."""
    if sample.first_turn is None:
        return list(turns)
    end = next((s for s in starts if s > sample.first_turn), None)
    return [i for i in turns if i >= sample.first_turn and (end is None or i < end)]


def _row_errors(
    tokenizer: PreTrainedTokenizerBase,
    response: SampledResponse,
    stored: Sequence[_StoredSample],
    starts: Sequence[int],
    max_seq_len: int | None,
    reasoning: str,
    chat_template_kwargs: dict[str, Any],
) -> list[str]:
    row = response.row
    turns = _assistant_turns(row)
    try:
        ids = turn_token_ids(row.get("turns") or [])
    except ValueError as exc:
        return [f"{response.origin}: token_ids: {exc}"]
    # Made from the ids only when every turn has them (tokenization.samples).
    engine = {i: pair for i, pair in zip(turns, ids, strict=False) if pair is not None}
    from_ids = reasoning != "drop" and len(ids) == len(engine) == len(turns) > 0
    errors: list[str] = []
    for sample in stored:
        where = f"{sample.where} ({response.origin})"
        trained = _trained_turns(sample, turns, starts)
        if from_ids:
            pairs = [(i, *engine[i]) for i in trained]
            errors += _engine_id_errors(tokenizer, where, sample, row, pairs, max_seq_len)
        else:
            cut = max_seq_len is not None and len(sample.input_ids) >= max_seq_len
            errors += _rendered_errors(
                tokenizer, where, sample, row, trained, reasoning, chat_template_kwargs, cut
            )
    return errors


def _engine_id_errors(
    tokenizer: PreTrainedTokenizerBase,
    where: str,
    sample: _StoredSample,
    row: Mapping[str, Any],
    turns: Sequence[tuple[int, Sequence[int], Sequence[int]]],
    max_seq_len: int | None,
) -> list[str]:
    """The supervised tokens against the completion ids of ``turns`` (message index,
    prompt ids, completion ids), and each whole completion's text against the row's."""
    length = len(sample.input_ids)
    errors = []
    # The sample is the last turn's prompt and completion ids, cut at max_seq_len.
    _, last_prompt, last_completion = turns[-1]
    row_length = len(last_prompt) + len(last_completion)
    if length != min(row_length, max_seq_len or row_length):
        errors.append(
            f"{where}: it holds {length} tokens where the row's ids of turn(s) "
            f"{[i for i, _, _ in turns]} make {row_length} (max_seq_len {max_seq_len})"
        )
    supervised = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
    # Each turn's completion follows its own prompt ids; those past a cut are not stored.
    want = [t for _, p, c in turns for j, t in enumerate(c) if len(p) + j < length]
    if supervised != want:
        at = next(
            (k for k, (a, b) in enumerate(zip(supervised, want, strict=False)) if a != b),
            min(len(supervised), len(want)),
        )
        errors.append(
            f"{where}: its supervised tokens are not the completion ids the response row "
            f"stores for turn(s) {[i for i, _, _ in turns]}: they part at supervised token "
            f"{at} of {len(want)} (stored {_decoded(tokenizer, supervised[at:])!r}, row "
            f"{_decoded(tokenizer, want[at:])!r})"
        )
    for i, prompt, completion in turns:
        if len(prompt) + len(completion) <= length:
            text = str(tokenizer.decode(list(completion)))
            message = row["messages"][i]
            fields = ("reasoning_content", "content")
            missing = _first_missing(text, [(f, _text_of(message.get(f))) for f in fields])
            if missing is not None:
                field, piece = missing
                errors.append(
                    f"{where}: turn {i}: its completion ids do not decode to its {field} "
                    f"(the row says {piece[:_SHOWN_CHARS]!r}, the ids "
                    f"{text[:_SHOWN_CHARS]!r})"
                )
    return errors


def _rendered_errors(
    tokenizer: PreTrainedTokenizerBase,
    where: str,
    sample: _StoredSample,
    row: Mapping[str, Any],
    turns: Sequence[int],
    reasoning: str,
    chat_template_kwargs: dict[str, Any],
    cut: bool,
) -> list[str]:
    """A re-rendered sample: each trained turn's supervised run against the turn's output
    as the template writes it (module docstring); a sample cut at max_seq_len is judged up
    to the cut (its last run may end early)."""
    messages = [dict(m) for m in row["messages"]]
    if reasoning == "drop":
        for m in messages:
            m.pop("reasoning_content", None)
    runs = _supervised_runs(sample.input_ids, sample.loss_mask)
    tools = row.get("tools")
    outputs = [
        _turn_output_text(tokenizer, messages, tools, i, chat_template_kwargs) for i in turns
    ]
    if None in outputs or (not cut and len(runs) != len(turns)) or len(runs) > len(turns):
        if not cut and None not in outputs:
            return [
                f"{where}: its supervised tokens form {len(runs)} run(s) where it trains "
                f"{len(turns)} assistant turn(s) {list(turns)}"
            ]
        # A template that re-renders history: the turns' texts, in order.
        return _text_errors(tokenizer, where, sample, row, turns, reasoning, cut)
    errors = []
    for n, (i, run) in enumerate(zip(turns, runs, strict=False)):
        output = outputs[n]
        assert output is not None
        problem = _run_problem(tokenizer, run, output, cut and n == len(runs) - 1)
        if problem is not None:
            errors.append(f"{where}: assistant turn {i}: {problem}")
    return errors


def _turn_output_text(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    tools: Any,
    i: int,
    chat_template_kwargs: dict[str, Any],
) -> str | None:
    """What the template writes for assistant turn ``i`` after its generation prompt; None
    when the turn's render does not extend its prompt (a template that re-renders
    history)."""
    from ..chat import THINK_CLOSE, render

    kwargs = {"chat_template_kwargs": chat_template_kwargs, "tools": tools}
    prompt = render(tokenizer, messages[:i], add_generation_prompt=True, **kwargs)
    full = render(tokenizer, messages[: i + 1], add_generation_prompt=False, **kwargs)
    if not full.startswith(prompt):
        return None
    output = full[len(prompt) :]
    thought = _text_of(messages[i].get("reasoning_content"))
    if thought and thought.strip() not in output and output.startswith(THINK_CLOSE):
        output = thought + output  # the prompt opened the block; the model wrote the rest
    return output


def _run_problem(
    tokenizer: PreTrainedTokenizerBase, run: Sequence[int], output: str, cut: bool
) -> str | None:
    """Why ``run`` is not the smallest run of tokens holding ``output``; None if it is. A
    run the sample's cut at max_seq_len ends early is judged on the part of ``output`` it
    holds, at its start only."""
    text = _decode_all(tokenizer, run)
    exact = _decode_all(tokenizer, tokenizer.encode(output, add_special_tokens=False)) == output
    norm = (lambda t: t) if exact else _squeezed
    wanted = norm(output)
    if cut:  # the longest start of the output the run holds (a longer one holds a shorter)
        lo, hi = 0, len(wanted)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if wanted[:mid] in norm(text) else (lo, mid - 1)
        wanted = wanted[:lo]
    if not wanted or wanted not in norm(text):
        return (
            f"its supervised tokens decode to {text[:_SHOWN_CHARS]!r}, which does not hold "
            f"the turn's output as the template writes it ({output[:_SHOWN_CHARS]!r})"
        )
    for side, rest, edge in (("start", run[1:], run[0]), ("end", run[:-1], run[-1])):
        if not rest or (cut and side == "end"):
            continue
        if not exact and not _decode_all(tokenizer, [edge]).strip():
            continue  # whitespace, where the tokenizer does not give it back exactly
        if wanted in norm(_decode_all(tokenizer, rest)):
            return _wider(side, text, output)
    return None


def _wider(side: str, text: str, output: str) -> str:
    return (
        f"its mask is wider than the turn's output at the {side}: the supervised tokens "
        f"decode to {text[:_SHOWN_CHARS]!r}...{text[-_SHOWN_CHARS // 2 :]!r}, the template "
        f"writes {output[:_SHOWN_CHARS]!r}...{output[-_SHOWN_CHARS // 2 :]!r}"
    )


def _decode_all(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> str:
    return str(tokenizer.decode(list(ids), clean_up_tokenization_spaces=False))


def _text_errors(
    tokenizer: PreTrainedTokenizerBase,
    where: str,
    sample: _StoredSample,
    row: Mapping[str, Any],
    turns: Sequence[int],
    reasoning: str,
    cut: bool,
) -> list[str]:
    """A sample of a template that re-renders history: the text of its supervised tokens
    holds its turns' reasoning (kept) and content, in order (cut: up to the cut)."""
    text = "".join(
        _decode_all(tokenizer, run) for run in _supervised_runs(sample.input_ids, sample.loss_mask)
    )
    fields = ("reasoning_content", "content") if reasoning == "keep" else ("content",)
    pieces = [
        (f"assistant turn {i}'s {f}", _text_of(row["messages"][i].get(f)))
        for i in turns
        for f in fields
    ]
    missing = _first_missing(text, pieces)
    if missing is None or cut:
        return []
    what, piece = missing
    return [f"{where}: the text of its supervised tokens lacks {what} ({piece[:_SHOWN_CHARS]!r})"]


def _first_missing(text: str, pieces: Sequence[tuple[str, str]]) -> tuple[str, str] | None:
    """The first (name, text) of ``pieces`` that ``text`` does not hold after the ones
    before it, whitespace aside; None when it holds them all in order."""
    rest = _squeezed(text)
    for name, piece in pieces:
        at = rest.find(_squeezed(piece))
        if at == -1:
            return name, piece
        rest = rest[at + len(_squeezed(piece)) :]
    return None


def _supervised_runs(input_ids: Sequence[int], loss_mask: Sequence[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    inside = False
    for token, supervised in zip(input_ids, loss_mask, strict=True):
        if supervised and not inside:
            runs.append([])
        if supervised:
            runs[-1].append(token)
        inside = bool(supervised)
    return runs


def _text_of(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _squeezed(text: str) -> str:
    """``text`` without whitespace: templates and reasoning parsers strip it."""
    return "".join(text.split())


def _decoded(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> str:
    return str(tokenizer.decode(list(ids[:_SHOWN])))
