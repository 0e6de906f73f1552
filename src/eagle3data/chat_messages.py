"""What the chat template is given: a conversation checked and made template input.

The roles, their order and each message's fields are checked (:func:`validated`), then each
message becomes the plain dict ``apply_chat_template`` takes: unset optional keys dropped,
each tool call's ``function.arguments`` JSON string decoded to the object it encodes (see
:mod:`eagle3data.chat`, "Tool calling"). The tools (:func:`template_tools`) and the extra
template variables (:func:`template_kwargs`) are checked here too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import ChatTemplateError

__all__ = ["Message", "template_kwargs", "template_tools", "validated"]

Message = Mapping[str, Any]

_ROLES = frozenset({"system", "user", "assistant", "tool"})
# Roles that may follow each role (None: the start, after an optional system message).
# An assistant turn without tool_calls may still be followed by tool turns: regenerated
# turns need not call the tools whose results the source gives.
_NEXT_ROLES: dict[str | None, tuple[str, ...]] = {
    None: ("user",),
    "user": ("assistant",),
    "assistant": ("user", "tool"),
    "tool": ("tool", "assistant"),
}
# Optional keys that mean "unset" when null; dropped so templates test them as absent.
_OPTIONAL_KEYS = ("tool_calls", "tool_call_id", "name")

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
        "tools",  # an argument of render() and friends
    }
)


def validated(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Check roles, order and fields; return plain dicts for ``apply_chat_template``
    (unset optional keys dropped, tool-call arguments decoded: see :mod:`eagle3data.chat`)."""
    if isinstance(messages, (str, bytes)) or not messages:
        raise ChatTemplateError("a conversation needs at least one message")

    conversation: list[dict[str, Any]] = []
    previous: str | None = None  # role of the previous non-system message
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"turn {i}: expected a mapping, got {type(message).__name__}")
        role = message.get("role")
        if role not in _ROLES:
            raise ChatTemplateError(f"turn {i}: role must be one of {sorted(_ROLES)}, got {role!r}")
        _check_fields(i, role, message)
        if role == "system":
            if i != 0:
                raise ChatTemplateError(f"turn {i}: a system message is only allowed first")
        elif role not in _NEXT_ROLES[previous]:
            raise ChatTemplateError(
                f"turn {i}: expected a {' or '.join(_NEXT_ROLES[previous])} message, got "
                f"{role} (conversations start with system or user and then alternate; "
                "tool results follow an assistant turn and are answered by one)"
            )
        else:
            previous = role
        conversation.append(_template_message(message))
    return conversation


def _check_fields(i: int, role: str, message: Mapping[str, Any]) -> None:
    content = message.get("content")
    if isinstance(content, list) and role == "user":
        _check_parts(i, content)
    elif not isinstance(content, str):
        raise ChatTemplateError(
            f"turn {i} ({role}): content must be a string"
            + (" or, on a user turn, a list of text and image parts" if role == "user" else "")
            + f", got {type(content).__name__}"
        )
    reasoning = message.get("reasoning_content")
    if reasoning is not None and (role != "assistant" or not isinstance(reasoning, str)):
        raise ChatTemplateError(
            f"turn {i} ({role}): reasoning_content must be a string on an assistant turn"
        )
    calls = message.get("tool_calls")
    if calls is not None and (role != "assistant" or not _are_tool_calls(calls)):
        raise ChatTemplateError(
            f"turn {i} ({role}): tool_calls must be a list of "
            "{id, type, function: {name, arguments}} on an assistant turn"
        )
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None and not isinstance(message[key], str):
            raise ChatTemplateError(f"turn {i} ({role}): {key} must be a string")


def _check_parts(i: int, parts: list[Any]) -> None:
    """A user turn's parts as :mod:`eagle3data.images` normalises them: chat templates
    render an ``image`` part as the model's image placeholder."""
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            continue
        if kind == "image" and isinstance(part.get("image"), str):
            continue
        raise ChatTemplateError(
            f"turn {i} (user): content[{k}] must be a text or an image part, got {part!r:.80}"
        )


def _are_tool_calls(calls: Any) -> bool:
    return isinstance(calls, list) and all(
        isinstance(c, Mapping)
        and isinstance(c.get("function"), Mapping)
        and isinstance(c["function"].get("name"), str)
        for c in calls
    )


def _template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in message.items() if not (k in _OPTIONAL_KEYS and v is None)}
    if "tool_calls" in out:
        if out["tool_calls"]:
            out["tool_calls"] = [_template_tool_call(c) for c in out["tool_calls"]]
        else:
            del out["tool_calls"]  # [] means none; some templates test for the key
    return out


def _template_tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    """The call with its ``arguments`` JSON string decoded when it encodes an object."""
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except ValueError:
            decoded = None
        if isinstance(decoded, dict):
            function["arguments"] = decoded
    return {**call, "function": function}


def template_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tool specs for the template; None (no tools) for None or an empty list."""
    if tools is None:
        return None
    if isinstance(tools, (str, bytes)) or not all(isinstance(t, Mapping) for t in tools):
        raise ChatTemplateError("tools must be a list of OpenAI tool specs (mappings)")
    return [dict(t) for t in tools] or None


def template_kwargs(chat_template_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    extra = dict(chat_template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(extra))
    if reserved:
        raise ValueError(
            f"chat_template_kwargs may not set {reserved}; they are not template variables"
        )
    return extra
