"""Read prompt sources in their formats and normalise them to conversations.

Every record becomes ``{"id", "messages": [{"role", "content"}], ...}`` with
roles system/user/assistant. Source assistant turns are kept as references;
generation regenerates one assistant turn after every user turn.

Bad records raise :class:`PromptFormatError` naming the file, line and field,
or, with ``on_invalid="skip"``, are returned as skips with the same message so
the caller can record them. Exact duplicate conversations are always dropped
and recorded (keeping the first): regenerating them twice buys nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..config import canonical_json
from ..errors import PromptFormatError

Format = Literal["sharegpt", "messages", "alpaca", "prompt"]
FORMATS: tuple[str, ...] = ("sharegpt", "messages", "alpaca", "prompt")
ROLES = ("system", "user", "assistant")
_SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
}


@dataclass(frozen=True)
class Skipped:
    file: str
    line: int
    reason: str
    id: str | None = None

    def as_row(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "id": self.id, "reason": self.reason}


@dataclass(frozen=True)
class Conversation:
    id: str
    messages: list[dict[str, str]]
    line: int
    prompt_hash: str = field(default="")


@dataclass
class ParseResult:
    conversations: list[Conversation]
    skipped: list[Skipped]


def prompt_hash(messages: list[dict[str, str]]) -> str:
    """Hash of what generation reads (system and user turns, in order)."""
    turns = [m for m in messages if m["role"] != "assistant"]
    return hashlib.sha256(canonical_json(turns).encode()).hexdigest()[:16]


def conversation_hash_id(messages: list[dict[str, str]]) -> str:
    return "h-" + hashlib.sha256(canonical_json(messages).encode()).hexdigest()[:16]


class _Bad(Exception):
    def __init__(self, field_path: str, problem: str) -> None:
        super().__init__(f"{field_path}: {problem}")


def _text(value: Any, field_path: str, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise _Bad(field_path, f"expected a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise _Bad(field_path, "empty text")
    return value


def _obj_list(record: Mapping[str, Any], key: str) -> list[Any]:
    if key not in record:
        raise _Bad(key, "missing field")
    value = record[key]
    if not isinstance(value, list) or not value:
        raise _Bad(key, "expected a non-empty list of turns")
    return value


def _turns(
    record: Mapping[str, Any], list_key: str, role_key: str, text_key: str, roles: Mapping[str, str]
) -> list[dict[str, str]]:
    """Read a list of turns whose role and text live under the given keys."""
    out = []
    for i, turn in enumerate(_obj_list(record, list_key)):
        where = f"{list_key}[{i}]"
        if not isinstance(turn, Mapping):
            raise _Bad(where, f"expected an object with {role_key!r} and {text_key!r}")
        if role_key not in turn:
            raise _Bad(f"{where}.{role_key}", "missing field")
        source_role = turn[role_key]
        role = roles.get(source_role) if isinstance(source_role, str) else None
        if role is None:
            raise _Bad(
                f"{where}.{role_key}",
                f"unknown role {source_role!r} (expected one of {list(roles)})",
            )
        if text_key not in turn:
            raise _Bad(f"{where}.{text_key}", "missing field")
        content = _text(turn[text_key], f"{where}.{text_key}", allow_empty=role == "assistant")
        out.append({"role": role, "content": content})
    return out


def _from_sharegpt(record: Mapping[str, Any]) -> list[dict[str, str]]:
    return _turns(record, "conversations", "from", "value", _SHAREGPT_ROLES)


def _from_messages(record: Mapping[str, Any]) -> list[dict[str, str]]:
    return _turns(record, "messages", "role", "content", {r: r for r in ROLES})


def _from_alpaca(record: Mapping[str, Any]) -> list[dict[str, str]]:
    if "instruction" not in record:
        raise _Bad("instruction", "missing field")
    instruction = _text(record["instruction"], "instruction")
    context = _text(record.get("input", ""), "input", allow_empty=True)
    user = f"{instruction}\n\n{context}" if context.strip() else instruction
    out = []
    if record.get("system"):
        out.append({"role": "system", "content": _text(record["system"], "system")})
    out.append({"role": "user", "content": user})
    if record.get("output"):
        out.append({"role": "assistant", "content": _text(record["output"], "output")})
    return out


def _from_prompt(record: Mapping[str, Any]) -> list[dict[str, str]]:
    if "prompt" not in record:
        raise _Bad("prompt", "missing field")
    out = []
    if record.get("system"):
        out.append({"role": "system", "content": _text(record["system"], "system")})
    out.append({"role": "user", "content": _text(record["prompt"], "prompt")})
    return out


_READERS = {
    "sharegpt": _from_sharegpt,
    "messages": _from_messages,
    "alpaca": _from_alpaca,
    "prompt": _from_prompt,
}


def _check_structure(messages: list[dict[str, str]]) -> None:
    """System turns only first; then user/assistant alternate starting with user."""
    body = messages[1:] if messages[0]["role"] == "system" else messages
    if not body:
        raise _Bad("messages", "no user turn")
    for i, m in enumerate(body):
        expected = "user" if i % 2 == 0 else "assistant"
        if m["role"] != expected:
            pos = i + (len(messages) - len(body))
            raise _Bad(
                f"turn[{pos}].role",
                f"expected {expected!r} here, got {m['role']!r} "
                "(conversations start with system or user and alternate user/assistant)",
            )


def _source_id(record: Mapping[str, Any]) -> str | None:
    for key in ("id", "conversation_id", "uuid"):
        if key in record and record[key] is not None:
            value = record[key]
            if isinstance(value, bool) or not isinstance(value, str | int):
                raise _Bad(key, f"expected a string or integer id, got {type(value).__name__}")
            text = str(value)
            if not text.strip():
                raise _Bad(key, "empty id")
            return text
    return None


def _records(path: Path) -> Iterator[tuple[int, Any]]:
    """Yield (line or record number, parsed JSON) from .jsonl or .json files."""
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise PromptFormatError(
                f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})"
            ) from None
        except json.JSONDecodeError as exc:
            raise PromptFormatError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
        if not isinstance(data, list):
            raise PromptFormatError(f"{path}: expected a JSON array of records")
        yield from enumerate(data, start=1)
        return
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield lineno, _Bad("(line)", f"not UTF-8 text ({exc.reason} at byte {exc.start})")
                continue
            if not text.strip():
                continue
            try:
                yield lineno, json.loads(text)
            except json.JSONDecodeError as exc:
                yield lineno, _Bad("(line)", f"invalid JSON: {exc.msg} at column {exc.colno}")


def read_prompts(
    path: str | Path, fmt: str, *, on_invalid: Literal["error", "skip"] = "error"
) -> ParseResult:
    """Parse a prompt source; raise or record (per ``on_invalid``) bad records."""
    src = Path(path)
    if fmt not in _READERS:
        raise PromptFormatError(f"{src}: unknown format {fmt!r} (expected one of {FORMATS})")
    if not src.is_file():
        raise PromptFormatError(f"{src}: prompt file not found")
    reader = _READERS[fmt]
    conversations: list[Conversation] = []
    skipped: list[Skipped] = []
    seen_ids: dict[str, int] = {}  # id -> first line
    seen_content: dict[str, int] = {}  # canonical messages -> first line

    # JSON arrays have no meaningful line numbers: name the record instead.
    where = "{src} record {n}" if src.suffix == ".json" else "{src}:{n}"

    def bad(lineno: int, reason: str, rid: str | None = None) -> None:
        if on_invalid == "error":
            raise PromptFormatError(f"{where.format(src=src, n=lineno)}: {reason}")
        skipped.append(Skipped(str(src), lineno, reason, rid))

    for lineno, record in _records(src):
        if isinstance(record, _Bad):
            bad(lineno, str(record))
            continue
        if not isinstance(record, Mapping):
            bad(lineno, f"(record): expected a JSON object, got {type(record).__name__}")
            continue
        try:
            rid = _source_id(record)
            messages = reader(record)
            _check_structure(messages)
        except _Bad as exc:
            bad(lineno, str(exc))
            continue
        canonical = canonical_json(messages)
        cid = rid if rid is not None else conversation_hash_id(messages)
        if canonical in seen_content:
            # The same conversation twice (whatever its ids) would only spend budget twice.
            first_line = seen_content[canonical]
            skipped.append(Skipped(str(src), lineno, f"duplicate of line {first_line}", cid))
            continue
        if cid in seen_ids:
            bad(lineno, f"id: duplicate id {cid!r} (first on line {seen_ids[cid]})", cid)
            continue
        seen_ids[cid] = lineno
        seen_content[canonical] = lineno
        conversations.append(Conversation(cid, messages, lineno, prompt_hash(messages)))
    return ParseResult(conversations, skipped)


def order_key(shuffle_seed: int, conversation_id: str) -> str:
    """Sort key of the seeded order.

    A hash of (seed, id) rather than a permutation of positions: adding prompts
    to a source keeps the relative order of the existing ones, so the prefix
    already generated stays a prefix.
    """
    return hashlib.sha256(f"{shuffle_seed}\x00{conversation_id}".encode()).hexdigest()


def seeded_order(conversations: list[Conversation], shuffle_seed: int) -> list[Conversation]:
    return sorted(conversations, key=lambda c: order_key(shuffle_seed, c.id))
