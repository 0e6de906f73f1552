"""The shards' loss masks checked against the response rows themselves.

The re-tokenization check makes samples again with the code that made them, so a
mask-placement bug in that code passes it. This check reads only the row and the shards:

* A row with the engine's token ids (every turn, ``tokenize.reasoning: keep``): each
  sample is as long as the ids of the last turn it trains (or ``max_seq_len``), its
  supervised tokens are exactly the completion ids the row stores for the turns the
  sample trains, in order (those inside ``max_seq_len`` when the sample was cut), and
  each turn's completion ids decode to the turn's reasoning and content, in that order
  (whitespace aside: reasoning parsers strip it).
* A row without ids (re-rendered): the text of each sample's supervised tokens holds the
  reasoning (unless dropped) and content of the assistant turns it trains, in order.

Which turns a sample trains comes from the ids (tokenization.table): the whole
conversation's sample all of them; ``{id}#{i}`` those from message index ``i`` up to the
next sample of the response (stored or recorded as dropped).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..generation.records import turn_token_ids
from ..shards import open_shard

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
        errors += _row_errors(tokenizer, response, stored[k], starts, max_seq_len, reasoning)
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
            errors += _text_errors(tokenizer, where, sample, row, trained, reasoning, cut)
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


def _text_errors(
    tokenizer: PreTrainedTokenizerBase,
    where: str,
    sample: _StoredSample,
    row: Mapping[str, Any],
    turns: Sequence[int],
    reasoning: str,
    cut: bool,
) -> list[str]:
    """The text of a re-rendered sample's supervised tokens against its turns' text (a
    sample cut at max_seq_len may lack what came after the cut)."""
    text = "".join(
        str(tokenizer.decode(run)) for run in _supervised_runs(sample.input_ids, sample.loss_mask)
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
