"""Read a prompt source record by record and turn it into conversations.

Records come from :mod:`.readers` (any format, streamed) and take their shape from
:mod:`.shapes`. Bad records raise :class:`PromptFormatError` naming the file, line
(or record) and field, or, with ``on_invalid="skip"``, come back as :class:`Skipped`
with the same message so the caller can record them. Conversations whose prompt side
(system, user and tool turns, and tools) equals an earlier one are always skipped and
recorded, keeping the first: regeneration ignores the reference answers, so generating
the same prompt twice only spends budget twice. A record naming an image that cannot be
read (missing, corrupt, a malformed data URI) is skipped and recorded whatever
``on_invalid`` says: the rest of the dataset is usable as it is.

Memory stays bounded by the batch the reader holds plus 8-byte digests of the ids
and prompts seen, so a multi-GB source streams through.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..config import canonical_json
from ..errors import PromptFormatError
from ..images import LoadedImage
from .readers import Location, RecordProblem, iter_records
from .shapes import FORMATS, ROLES, Bad, FieldMap, UnreadableImage, normalise

__all__ = [
    "FORMATS",
    "ROLES",
    "Conversation",
    "IngestStats",
    "ParseResult",
    "PromptFormatError",
    "Skipped",
    "conversation_hash_id",
    "iter_conversations",
    "order_key",
    "prompt_hash",
    "read_prompts",
    "seeded_order",
]


@dataclass(frozen=True)
class Skipped:
    file: str
    line: int | None
    reason: str
    id: str | None = None
    record: int | None = None

    def as_row(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "line": self.line,
            "record": self.record,
            "id": self.id,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class Conversation:
    id: str
    messages: list[dict[str, Any]]
    line: int | None
    prompt_hash: str = field(default="")
    tools: list[dict[str, Any]] | None = None
    file: str = ""
    record: int | None = None
    # The distinct images of the messages (first-seen order), carried from ingest to the
    # image table: the stage writes them and keeps the conversation without them.
    images: tuple[LoadedImage, ...] = field(default=(), repr=False)


@dataclass
class IngestStats:
    """What the source held: the stage reports it and judges skip mode by it."""

    records: int = 0
    invalid: int = 0
    duplicates: int = 0
    unused_fields: Counter[str] = field(default_factory=Counter)
    duplicate_key_records: int = 0
    first_duplicate_keys: str | None = None
    reasons: Counter[str] = field(default_factory=Counter)  # skipped records by field
    unreadable_images: int = 0  # records skipped for an image that cannot be read

    @property
    def usable(self) -> int:
        """Records that are neither invalid nor skipped for an image (duplicates count)."""
        return self.records - self.invalid - self.unreadable_images

    @property
    def valid_share(self) -> float:
        return self.usable / self.records if self.records else 0.0

    def warnings(self) -> list[str]:
        """One line per kind of thing that was read but not used, with its count."""
        lines = [
            f"field {name!r} ignored in {count} record(s): it is not part of the prompt shape "
            "(map it with datasets.NAME.fields if it should be)"
            for name, count in sorted(self.unused_fields.items())
        ]
        if self.duplicate_key_records:
            lines.append(
                f"{self.duplicate_key_records} record(s) repeat a JSON key; the last value was "
                f"kept (first: {self.first_duplicate_keys})"
            )
        return lines


@dataclass
class ParseResult:
    conversations: list[Conversation]
    skipped: list[Skipped]
    stats: IngestStats = field(default_factory=IngestStats)


def prompt_hash(messages: list[dict[str, Any]], tools: list[Any] | None = None) -> str:
    """Hash of what generation reads: system, user and tool turns in order, and tools."""
    turns = [m for m in messages if m["role"] != "assistant"]
    keyed: Any = turns if tools is None else {"turns": turns, "tools": tools}
    return hashlib.sha256(canonical_json(keyed).encode()).hexdigest()[:16]


def conversation_hash_id(messages: list[dict[str, Any]], tools: list[Any] | None = None) -> str:
    keyed: Any = messages if tools is None else {"messages": messages, "tools": tools}
    return "h-" + hashlib.sha256(canonical_json(keyed).encode()).hexdigest()[:16]


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=8).digest()


def _source_id(record: Mapping[str, Any]) -> str | None:
    for key in ("id", "conversation_id", "uuid"):
        if key in record and record[key] is not None:
            value = record[key]
            if isinstance(value, bool) or not isinstance(value, str | int):
                raise Bad(key, f"expected a string or integer id, got {type(value).__name__}")
            text = str(value)
            if not text.strip():
                raise Bad(key, "empty id")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise Bad(key, "holds a lone surrogate: not valid Unicode text") from None
            return text
    return None


class _Seen:
    """First place of each id and prompt, by 8-byte digest (collisions: ~1e-8 at 1e6).

    A place is packed into one int (file number, whether it is a line, the number), so a
    million records cost tens of MB here, not a Location object each.
    """

    def __init__(self) -> None:
        self.ids: dict[bytes, int] = {}
        self.prompts: dict[bytes, tuple[int, int]] = {}
        self.files: list[str] = []
        self._file_numbers: dict[str, int] = {}

    def pack(self, location: Location) -> int:
        number = self._file_numbers.setdefault(location.file, len(self.files))
        if number == len(self.files):
            self.files.append(location.file)
        is_line = location.line is not None
        return (number << 41) | (is_line << 40) | (location.line if is_line else location.record)

    def describe(self, packed: int, now: Location) -> str:
        """How a later record names an earlier one: its line in JSON Lines, else its record."""
        file = self.files[packed >> 41]
        place = f"{'line' if packed >> 40 & 1 else 'record'} {packed & ((1 << 40) - 1)}"
        return place if file == now.file else f"{file} {place}"


def iter_conversations(
    path: str | Path,
    fmt: str = "auto",
    *,
    on_invalid: Literal["error", "skip"] = "error",
    split: str | None = None,
    fields: Mapping[str, Any] | None = None,
    stats: IngestStats | None = None,
) -> Iterator[Conversation | Skipped]:
    """Conversations and skips in source order; fills ``stats`` as it goes."""
    if fmt not in FORMATS:
        raise PromptFormatError(f"{path}: unknown format {fmt!r} (expected one of {FORMATS})")
    field_map = FieldMap.from_config(fields)
    stats = stats if stats is not None else IngestStats()
    seen = _Seen()

    def bad(location: Location, reason: str, rid: str | None = None) -> Skipped:
        stats.invalid += 1
        stats.reasons[reason.split(":", 1)[0]] += 1
        if on_invalid == "error":
            raise PromptFormatError(f"{location}: {reason}")
        return Skipped(location.file, location.line, reason, rid, location.record)

    def unreadable(location: Location, reason: str, rid: str | None) -> Skipped:
        stats.unreadable_images += 1
        stats.reasons[reason.split(":", 1)[0]] += 1
        return Skipped(location.file, location.line, reason, rid, location.record)

    for item in iter_records(path, split=split):
        stats.records += 1
        location = item.location
        if item.duplicate_keys:
            stats.duplicate_key_records += 1
            if stats.first_duplicate_keys is None:
                stats.first_duplicate_keys = f"{location}: {', '.join(item.duplicate_keys)}"
        record = item.value
        if isinstance(record, RecordProblem):
            yield bad(location, str(record))
            continue
        if not isinstance(record, Mapping):
            yield bad(location, f"(record): expected a JSON object, got {type(record).__name__}")
            continue
        rid = None
        try:
            rid = _source_id(record)
            shaped = normalise(record, fmt, field_map, location.file)
        except UnreadableImage as exc:
            yield unreadable(location, str(exc), rid)
            continue
        except Bad as exc:
            yield bad(location, str(exc))
            continue
        stats.unused_fields.update(shaped.unused)
        messages, tools = shaped.messages, shaped.tools
        cid = rid if rid is not None else conversation_hash_id(messages, tools)
        phash = prompt_hash(messages, tools)
        # Within one run only (str hashes are salted per process): which reference it had.
        whole = hash(tuple(repr(m) for m in messages if m["role"] == "assistant"))
        prompt_digest = _digest(phash)
        first = seen.prompts.get(prompt_digest)
        if first is not None:
            # Regeneration reads only the prompt side: a second copy would spend budget twice.
            first_location, first_whole = first
            what = "duplicate" if first_whole == whole else "duplicate prompt (reference differs)"
            stats.duplicates += 1
            yield Skipped(
                location.file,
                location.line,
                f"{what} of {seen.describe(first_location, location)}",
                cid,
                location.record,
            )
            continue
        id_digest = _digest(cid)
        if id_digest in seen.ids:
            first_location = seen.ids[id_digest]
            yield bad(
                location,
                f"id: duplicate id {cid!r} (first on {seen.describe(first_location, location)})",
                cid,
            )
            continue
        packed = seen.pack(location)
        seen.ids[id_digest] = packed
        seen.prompts[prompt_digest] = (packed, whole)
        yield Conversation(
            cid,
            messages,
            location.line,
            phash,
            tools,
            location.file,
            location.record,
            tuple(shaped.images),
        )


def read_prompts(
    path: str | Path,
    fmt: str = "auto",
    *,
    on_invalid: Literal["error", "skip"] = "error",
    split: str | None = None,
    fields: Mapping[str, Any] | None = None,
) -> ParseResult:
    """The whole source in memory: for tests and small sources (the stage streams)."""
    result = ParseResult([], [])
    for item in iter_conversations(
        path, fmt, on_invalid=on_invalid, split=split, fields=fields, stats=result.stats
    ):
        (result.conversations if isinstance(item, Conversation) else result.skipped).append(item)
    return result


def order_key(shuffle_seed: int, conversation_id: str) -> str:
    """Sort key of the seeded order.

    A hash of (seed, id) rather than a permutation of positions: adding prompts
    to a source keeps the relative order of the existing ones, so the prefix
    already generated stays a prefix.
    """
    return hashlib.sha256(f"{shuffle_seed}\x00{conversation_id}".encode()).hexdigest()


def seeded_order(conversations: list[Conversation], shuffle_seed: int) -> list[Conversation]:
    return sorted(conversations, key=lambda c: order_key(shuffle_seed, c.id))
