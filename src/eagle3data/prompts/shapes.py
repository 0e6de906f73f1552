"""Record shapes: turn one decoded record into a normalised conversation.

The normalised form, shared by the prompts table, generation and tokenization::

    messages: [{"role": "system"|"user"|"assistant"|"tool",
                "content": str, or in a user turn with images a list of parts
                           [{"type": "text", "text": str} | {"type": "image", "image": sha256}],
                # optional, only when set:
                "tool_calls": [{"id"?, "type": "function",
                                "function": {"name": str, "arguments": str (JSON)}}],
                "tool_call_id": str, "name": str}]
    tools:    None | [{"type": "function", "function": {...}}]

Shapes (``format``): ``auto`` tries them in the order below for each record;
``sharegpt``/``messages`` (a list of turns under ``messages``, ``conversations`` or
``conversation``, each turn ``role``/``content`` or ``from``/``value``),
``alpaca`` (``instruction``/``input``/``output`` with ``history``; dolly's
``context``/``response``) and ``prompt`` (``prompt``). A ``fields`` mapping names
the keys of anything else. Images (:mod:`.image_inputs`) are read and hashed here. A
problem raises :class:`Bad` naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..images import LoadedImage
from .image_inputs import (
    AUDIO_VIDEO,
    AUDIO_VIDEO_KEYS,
    AUDIO_VIDEO_PART_TYPES,
    IMAGE_PART_TYPES,
    RecordImages,
    canonical_parts,
    image_reference,
    place_top_level_images,
)
from .problems import Bad, UnreadableImage

__all__ = ["FORMATS", "ROLES", "Bad", "FieldMap", "Normalised", "UnreadableImage", "normalise"]

FORMATS: tuple[str, ...] = ("auto", "sharegpt", "messages", "alpaca", "prompt")
ROLES = ("system", "user", "assistant", "tool")

# Role spellings of the public chat datasets (ShareGPT, LMSYS, Gemini-style exports).
ROLE_SPELLINGS: dict[str, str] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "tool": "tool",
    "function": "tool",  # OpenAI's legacy name for a function result
}
_LIST_KEYS = ("messages", "conversations", "conversation")
_SYSTEM_KEYS = ("system", "system_prompt")
# Top-level keys that carry no prompt text: ignored without a warning.
_METADATA_KEYS = frozenset(
    {
        "id", "conversation_id", "uuid", "idx", "index", "source", "category", "model",
        "language", "lang", "turn", "redacted", "openai_moderation", "hash", "title", "views",
        "avatarUrl", "topic", "skip_prompt_formatting", "custom_instruction", "weight", "task",
        "dataset", "score", "timestamp", "license", "url", "prompt_id", "length", "num_turns",
        "token_count", "tags", "split", "subset", "model_name",
        # Magpie's generation metadata
        "gen_input_configs", "intent", "knowledge", "difficulty", "input_quality",
        "quality_explanation", "task_category", "other_task_category",
        "task_category_generator", "llama_guard_2", "instruct_reward", "reward_model",
        "min_neighbor_distance", "repeat_count", "min_similar_uuid", "response_length",
        "input_length",
        # WildChat / LMSYS moderation and provenance
        "conversation_hash", "detoxify_moderation", "toxic", "state", "country", "hashed_ip",
        "header",
    }
)  # fmt: skip
# Turn keys that change nothing we send: ignored without a warning.
_TURN_METADATA_KEYS = frozenset({"weight", "loss", "train", "mask", "timestamp", "id"})
_TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})
_PART_TYPES = sorted(_TEXT_PART_TYPES | IMAGE_PART_TYPES)


@dataclass(frozen=True)
class FieldMap:
    """The ``datasets.NAME.fields`` option: which keys hold what, for any other shape."""

    messages: str | None = None
    role: str | None = None
    content: str | None = None
    prompt: str | None = None
    response: str | None = None
    system: str | None = None
    tools: str | None = None
    roles: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_config(cls, fields: Mapping[str, Any] | None) -> FieldMap:
        return cls(**dict(fields or {}))


@dataclass
class Normalised:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    unused: list[str]  # fields that could change the prompt and were not used
    images: list[LoadedImage] = field(default_factory=list)  # distinct, first-seen order


def normalise(
    record: Mapping[str, Any], fmt: str, fields: FieldMap, source_file: str = ""
) -> Normalised:
    """The conversation a record holds, in the normalised form; raise :class:`Bad`.

    ``source_file`` is the file the record came from: image paths are relative to it.
    """
    _reject_audio_video_fields(record)
    images = RecordImages(record, source_file)
    used: set[str] = set(_METADATA_KEYS)
    if images.key is not None:
        used.add(images.key)
    unused: list[str] = []
    shape = _shape_of(record, fmt, fields)
    if shape == "chat":
        messages = _chat(record, fmt, fields, used, unused, images)
        first_user = next((m["content"] for m in messages if m["role"] == "user"), None)
        if record.get("prompt") == first_user:
            used.add("prompt")  # UltraChat's copy of the first user turn
    elif shape == "alpaca":
        messages = _alpaca(record, used)
    else:
        messages = _prompt(record, fields, used, images)
    tools = _tools(record, fields, used)
    check_structure(messages)
    if images.key is not None:
        place_top_level_images(messages, images)
    unused += sorted(k for k, v in record.items() if k not in used and not _empty(v))
    return Normalised(messages, tools, unused, images.in_order(messages))


# ----------------------------------------------------------------------------- shapes


def _shape_of(record: Mapping[str, Any], fmt: str, fields: FieldMap) -> str:
    if fields.messages:
        return "chat"
    if fields.prompt:
        return "prompt"
    if fmt in ("sharegpt", "messages"):
        return "chat"
    if fmt in ("alpaca", "prompt"):
        return fmt
    if any(record.get(k) is not None for k in _LIST_KEYS):
        return "chat"
    if "instruction" in record:
        return "alpaca"
    if "prompt" in record:
        return "prompt"
    keys = ", ".join(sorted(record)) or "none"
    raise Bad(
        "(record)",
        "no known shape (expected a list of turns under messages/conversations/conversation, "
        f"an alpaca/dolly instruction, or a prompt; keys found: {keys}); "
        "map the keys with datasets.NAME.fields",
    )


def _chat(
    record: Mapping[str, Any],
    fmt: str,
    fields: FieldMap,
    used: set[str],
    unused: list[str],
    images: RecordImages,
) -> list[dict[str, Any]]:
    if fields.messages:
        list_key = fields.messages
    else:
        present = [k for k in _LIST_KEYS if record.get(k) is not None]
        default = "conversations" if fmt == "sharegpt" else "messages"
        list_key = present[0] if present else default
    used.add(list_key)
    turns = record.get(list_key)
    if turns is None:
        raise Bad(list_key, "missing field")
    if not isinstance(turns, list) or not turns:
        raise Bad(list_key, "expected a non-empty list of turns")
    roles = {**ROLE_SPELLINGS, **fields.roles}
    messages = [
        _turn(turn, f"{list_key}[{i}]", fmt, fields, roles, unused, images)
        for i, turn in enumerate(turns)
    ]
    system = _top_level_system(record, fields, used)
    if system is not None:
        if messages[0]["role"] == "system":
            raise Bad(_system_key(record, fields), "a system field and a system turn both given")
        messages.insert(0, {"role": "system", "content": system})
    return messages


def _turn(
    turn: Any,
    where: str,
    fmt: str,
    fields: FieldMap,
    roles: Mapping[str, str],
    unused: list[str],
    images: RecordImages,
) -> dict[str, Any]:
    if not isinstance(turn, Mapping):
        raise Bad(where, "expected an object with a role and a content")
    # ShareGPT spells a turn from/value, everything else role/content; a turn missing one
    # of its keys is named in the spelling its other key (or the format) implies.
    sharegpt = "from" in turn or "value" in turn or (fmt == "sharegpt" and "role" not in turn)
    role_key = fields.role or ("from" if sharegpt and "role" not in turn else "role")
    text_key = fields.content or ("value" if sharegpt and "content" not in turn else "content")
    if turn.get(role_key) is None:
        raise Bad(f"{where}.{role_key}", "missing field")
    source_role = turn[role_key]
    role = roles.get(source_role) if isinstance(source_role, str) else None
    if role is None:
        raise Bad(
            f"{where}.{role_key}",
            f"unknown role {source_role!r} (expected one of {sorted(roles)}; "
            "map others with datasets.NAME.fields.roles)",
        )
    message: dict[str, Any] = {"role": role}
    tool_calls = turn.get("tool_calls")
    if tool_calls is not None and role == "assistant":
        message["tool_calls"] = _tool_calls(tool_calls, f"{where}.tool_calls")
    if text_key not in turn and not (role == "assistant" and "tool_calls" in message):
        raise Bad(f"{where}.{text_key}", "missing field")
    message["content"] = _content(
        turn.get(text_key),
        f"{where}.{text_key}",
        role,
        images,
        # An empty system turn renders differently from none (Qwen's default system prompt
        # appears only without one), so it is kept as the source gave it.
        allow_empty=role in ("system", "assistant", "tool"),
        allow_null="tool_calls" in message,
    )
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if turn.get(key) is not None:
                message[key] = text(turn[key], f"{where}.{key}")
    known = {role_key, text_key, "tool_calls", "tool_call_id", "name", *_TURN_METADATA_KEYS}
    if role != "assistant":  # a source assistant turn is a reference: its extras change nothing
        unused += [
            f"{where.split('[')[0]}[].{k}"
            for k, v in turn.items()
            if k not in known and not _empty(v)
        ]
    return message


def _alpaca(record: Mapping[str, Any], used: set[str]) -> list[dict[str, Any]]:
    used.update({"instruction", "input", "context", "output", "response", "history"})
    used.update(_SYSTEM_KEYS)
    if record.get("instruction") is None:
        raise Bad("instruction", "missing field")
    instruction = text(record["instruction"], "instruction")
    extra = [
        (k, text(record[k], k, allow_empty=True))
        for k in ("input", "context")  # alpaca's input, dolly's context
        if record.get(k) is not None
    ]
    user = "\n\n".join([instruction, *(v for _, v in extra if v.strip())])
    messages: list[dict[str, Any]] = []
    system = next(
        (text(record[k], k) for k in _SYSTEM_KEYS if not _empty(record.get(k))),
        None,
    )
    if system is not None:
        messages.append({"role": "system", "content": system})
    messages += _history(record.get("history"))
    messages.append({"role": "user", "content": user})
    for key in ("output", "response"):
        if not _empty(record.get(key)):
            messages.append({"role": "assistant", "content": text(record[key], key)})
            break
    return messages


def _history(history: Any) -> list[dict[str, Any]]:
    """Alpaca/LLaMA-Factory ``history``: earlier [instruction, response] pairs."""
    if _empty(history):
        return []
    if not isinstance(history, list):
        raise Bad("history", "expected a list of [instruction, response] pairs")
    out = []
    for i, pair in enumerate(history):
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise Bad(f"history[{i}]", "expected an [instruction, response] pair")
        out.append({"role": "user", "content": text(pair[0], f"history[{i}][0]")})
        out.append(
            {"role": "assistant", "content": text(pair[1], f"history[{i}][1]", allow_empty=True)}
        )
    return out


def _prompt(
    record: Mapping[str, Any], fields: FieldMap, used: set[str], images: RecordImages
) -> list[dict[str, Any]]:
    key = fields.prompt or "prompt"
    used.add(key)
    if record.get(key) is None:
        raise Bad(key, "missing field")
    messages: list[dict[str, Any]] = []
    system = _top_level_system(record, fields, used)
    if system is not None:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": _content(record[key], key, "user", images)})
    response_key = fields.response or "response"
    used.update({response_key, "completion", "output"})
    if not _empty(record.get(response_key)):
        messages.append(
            {
                "role": "assistant",
                "content": _content(record[response_key], response_key, "assistant", images),
            }
        )
    return messages


def _system_key(record: Mapping[str, Any], fields: FieldMap) -> str:
    keys = [fields.system] if fields.system else list(_SYSTEM_KEYS)
    return next((k for k in keys if not _empty(record.get(k))), keys[0])


def _top_level_system(record: Mapping[str, Any], fields: FieldMap, used: set[str]) -> str | None:
    """LLaMA-Factory's and others' ``system`` field: the conversation's system prompt."""
    keys = [fields.system] if fields.system else list(_SYSTEM_KEYS)
    used.update(keys)
    key = _system_key(record, fields)
    value = record.get(key)
    return None if _empty(value) else text(value, key)


# ----------------------------------------------------------------------------- tools


def _tools(
    record: Mapping[str, Any], fields: FieldMap, used: set[str]
) -> list[dict[str, Any]] | None:
    key = fields.tools or "tools"
    used.add(key)
    value = record.get(key)
    if _empty(value):
        return None
    if isinstance(value, str):  # LLaMA-Factory and glaive store them as a JSON string
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise Bad(key, f"a string that is not JSON ({exc.msg})") from None
    if not isinstance(value, list) or not value:
        raise Bad(key, "expected a list of tool specs")
    tools = []
    for i, spec in enumerate(value):
        if not isinstance(spec, Mapping):
            raise Bad(f"{key}[{i}]", "expected an object")
        if "function" not in spec and "name" in spec:
            spec = {"type": "function", "function": dict(spec)}  # a bare function spec
        _check_json_text(spec, f"{key}[{i}]")
        tools.append(_without_nulls(spec))
    return tools


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise Bad(where, "expected a non-empty list of tool calls")
    calls = []
    for i, call in enumerate(value):
        here = f"{where}[{i}]"
        if not isinstance(call, Mapping):
            raise Bad(here, "expected an object")
        function = call.get("function", call)  # a bare {name, arguments} call
        if not isinstance(function, Mapping):
            raise Bad(f"{here}.function", "expected an object with name and arguments")
        name = text(function.get("name"), f"{here}.function.name")
        arguments = function.get("arguments", {})
        if not isinstance(arguments, str):  # OpenAI sends a JSON string; datasets often a dict
            _check_json_text(arguments, f"{here}.function.arguments")
            arguments = json.dumps(arguments, ensure_ascii=False)
        else:
            arguments = text(arguments, f"{here}.function.arguments", allow_empty=True)
        normalised: dict[str, Any] = {
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        if call.get("id") is not None:
            normalised = {"id": text(call["id"], f"{here}.id"), **normalised}
        calls.append(normalised)
    return calls


# ----------------------------------------------------------------------------- text


def text(value: Any, field_path: str, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        got = "null" if value is None else type(value).__name__
        raise Bad(field_path, f"expected a string, got {got}")
    if not allow_empty and not value.strip():
        raise Bad(field_path, "empty text")
    _check_unicode(value, field_path)
    return value


def _content(
    value: Any,
    field_path: str,
    role: str,
    images: RecordImages,
    *,
    allow_empty: bool = False,
    allow_null: bool = False,
) -> str | list[dict[str, Any]]:
    """Text, or a list of parts: text parts alone are joined as chat templates join them
    (no separator); with an image they stay a list of normalised parts."""
    if value is None and allow_null:
        return ""
    if isinstance(value, list):
        pieces = [_part(part, f"{field_path}[{i}]", role, images) for i, part in enumerate(value)]
        texts = [piece for piece in pieces if isinstance(piece, str)]
        if len(texts) < len(pieces):  # an image among them
            return canonical_parts(pieces)
        value = "".join(texts)
    return text(value, field_path, allow_empty=allow_empty)


def _part(part: Any, where: str, role: str, images: RecordImages) -> str | dict[str, Any]:
    """A content part: its text, or a normalised image part."""
    if isinstance(part, str):
        return part
    if not isinstance(part, Mapping):
        raise Bad(where, f"expected a content part object, got {type(part).__name__}")
    kind = part.get("type", "text")
    if kind in _TEXT_PART_TYPES:
        return text(part.get("text"), f"{where}.text", allow_empty=True)
    if kind in IMAGE_PART_TYPES:
        if role != "user":
            raise Bad(
                f"{where}.type", f"an image in a {role} turn: only user turns may carry images"
            )
        value, field_path = image_reference(part, kind, where)
        return images.part(value, field_path)
    if kind in AUDIO_VIDEO_PART_TYPES:
        raise Bad(f"{where}.type", f"{kind!r} part: {AUDIO_VIDEO}")
    raise Bad(
        f"{where}.type", f"unknown content part type {kind!r} (expected one of {_PART_TYPES})"
    )


def _check_unicode(value: str, field_path: str) -> None:
    # json accepts "\ud800"; nothing downstream (UTF-8 files, tokenizers) can hold it.
    if value.isascii():
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = value[exc.start]
        raise Bad(
            field_path,
            f"lone surrogate \\u{ord(bad):04x} at character {exc.start}: not valid Unicode text",
        ) from None


def _check_json_text(value: Any, field_path: str) -> None:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise Bad(field_path, "holds a lone surrogate: not valid Unicode text") from None
    except (TypeError, ValueError) as exc:
        raise Bad(field_path, f"not JSON data ({exc})") from None


def _reject_audio_video_fields(record: Mapping[str, Any]) -> None:
    for key in AUDIO_VIDEO_KEYS:
        if not _empty(record.get(key)):
            raise Bad(key, f"{AUDIO_VIDEO} (the record carries {key} data)")
    if not _empty(record.get("image_url")):
        raise Bad("image_url", "a top-level image_url is not read: give image/images or parts")


def _empty(value: Any) -> bool:
    return value is None or (not value and isinstance(value, str | list | dict))


def _without_nulls(value: Any) -> Any:
    """Parquet structs give every absent field as null: drop them so specs stay as written."""
    if isinstance(value, Mapping):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


# ----------------------------------------------------------------------------- structure


def check_structure(messages: Sequence[Mapping[str, Any]]) -> None:
    """System first, then user; user and assistant alternate; tool turns follow an
    assistant turn that called tools, and an assistant turn follows them."""
    offset = 1 if messages and messages[0]["role"] == "system" else 0
    if len(messages) == offset:
        raise Bad("messages", "no user turn")
    previous: Mapping[str, Any] | None = None
    for pos in range(offset, len(messages)):
        message = messages[pos]
        allowed = _allowed_after(previous)
        if message["role"] not in allowed:
            expected = " or ".join(repr(r) for r in allowed)
            raise Bad(
                f"turn[{pos}].role",
                f"expected {expected} here, got {message['role']!r} "
                "(conversations start with system or user and alternate user/assistant; "
                "tool turns follow an assistant turn with tool_calls)",
            )
        previous = message
    return None


def _allowed_after(previous: Mapping[str, Any] | None) -> tuple[str, ...]:
    if previous is None:
        return ("user",)
    role = previous["role"]
    if role == "user":
        return ("assistant",)
    if role == "assistant":
        return ("user", "tool") if previous.get("tool_calls") else ("user",)
    return ("tool", "assistant")  # after a tool result
