"""Record shapes of the public chat datasets, tool calling, and what is never dropped."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import pytest

from eagle3data.prompts.sources import PromptFormatError, prompt_hash, read_prompts


def jsonl(tmp_path: Path, *records: object, name: str = "A1.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def only(tmp_path: Path, record: object, fmt: str = "auto", **kwargs):
    (conv,) = read_prompts(jsonl(tmp_path, record), fmt, **kwargs).conversations
    return conv


def error(tmp_path: Path, record: object, fmt: str = "auto", **kwargs) -> str:
    path = jsonl(tmp_path, record)
    with pytest.raises(PromptFormatError) as info:
        read_prompts(path, fmt, **kwargs)
    message = str(info.value)
    assert message.startswith(f"{path}:1: ") and "\n" not in message
    skipped = read_prompts(path, fmt, on_invalid="skip", **kwargs)
    assert skipped.conversations == [] and len(skipped.skipped) == 1
    return message.removeprefix(f"{path}:1: ")


# A 1x1 PNG.
CAT_PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)
USER_ASSISTANT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]


# ----------------------------------------------------------------------------- detection


@pytest.mark.parametrize(
    "record",
    [
        {"messages": USER_ASSISTANT},
        {"conversation": USER_ASSISTANT, "model": "vicuna-13b", "language": "English"},  # LMSYS
        {"conversations": USER_ASSISTANT},  # SpecForge's prepared files
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]},
    ],
    ids=["messages", "lmsys", "specforge", "sharegpt"],
)
def test_chat_shapes_are_detected(tmp_path, record) -> None:
    conv = only(tmp_path, record)
    assert conv.messages == USER_ASSISTANT and conv.tools is None
    assert read_prompts(jsonl(tmp_path, record, name="b.jsonl"), "auto").stats.warnings() == []


def test_ultrachat_prompt_copy_is_not_warned_about(tmp_path) -> None:
    record = {"prompt": "Hi", "prompt_id": "p1", "messages": USER_ASSISTANT}
    path = jsonl(tmp_path, record)
    result = read_prompts(path)
    assert result.conversations[0].messages == USER_ASSISTANT
    assert result.stats.warnings() == []


def test_an_explicit_format_accepts_either_turn_spelling(tmp_path) -> None:
    assert only(tmp_path, {"conversations": USER_ASSISTANT}, "sharegpt").messages == USER_ASSISTANT


def test_unknown_shape_names_the_keys_and_the_mapping_option(tmp_path) -> None:
    message = error(tmp_path, {"question": "Hi", "answer": "Yo"})
    assert message.startswith("(record): no known shape")
    assert "keys found: answer, question" in message and "datasets.NAME.fields" in message


def test_fields_mapping_reads_any_shape(tmp_path) -> None:
    record = {
        "dialog": [{"speaker": "customer", "text": "Hi"}, {"speaker": "agent", "text": "Yo"}],
        "persona": "Be brief.",
    }
    fields = {
        "messages": "dialog",
        "role": "speaker",
        "content": "text",
        "system": "persona",
        "roles": {"customer": "user", "agent": "assistant"},
    }
    conv = only(tmp_path, record, fields=fields)
    assert conv.messages == [{"role": "system", "content": "Be brief."}, *USER_ASSISTANT]


def test_fields_mapping_for_single_turn_prompts(tmp_path) -> None:
    conv = only(tmp_path, {"q": "Hi", "a": "Yo"}, fields={"prompt": "q", "response": "a"})
    assert conv.messages == USER_ASSISTANT


# ----------------------------------------------------------------------------- never dropped


def test_top_level_system_becomes_the_system_turn(tmp_path) -> None:
    conv = only(tmp_path, {"system": "Be brief.", "conversations": USER_ASSISTANT})
    assert conv.messages[0] == {"role": "system", "content": "Be brief."}


def test_system_field_and_system_turn_together_is_an_error(tmp_path) -> None:
    record = {"system": "A", "messages": [{"role": "system", "content": "B"}, *USER_ASSISTANT]}
    assert error(tmp_path, record).startswith("system: a system field and a system turn")


def test_alpaca_history_precedes_the_instruction(tmp_path) -> None:
    record = {
        "instruction": "And now?",
        "input": "",
        "output": "Done.",
        "history": [["First?", "One."], ["Second?", "Two."]],
    }
    conv = only(tmp_path, record)
    assert [(m["role"], m["content"]) for m in conv.messages] == [
        ("user", "First?"),
        ("assistant", "One."),
        ("user", "Second?"),
        ("assistant", "Two."),
        ("user", "And now?"),
        ("assistant", "Done."),
    ]


def test_dolly_context_joins_the_instruction(tmp_path) -> None:
    record = {"instruction": "Summarise.", "context": "Long text.", "response": "Short.",
              "category": "summarization"}  # fmt: skip
    conv = only(tmp_path, record)
    assert conv.messages == [
        {"role": "user", "content": "Summarise.\n\nLong text."},
        {"role": "assistant", "content": "Short."},
    ]


def test_unused_fields_are_named_with_a_count(tmp_path) -> None:
    path = jsonl(
        tmp_path,
        {"messages": USER_ASSISTANT, "persona": "pirate"},
        {"messages": [{"role": "user", "content": "B"}], "persona": "cat"},
        {"messages": [{"role": "user", "content": "C", "lang_hint": "fr"}]},
    )
    warnings = read_prompts(path).stats.warnings()
    assert any("'persona' ignored in 2 record(s)" in w for w in warnings)
    assert any("'messages[].lang_hint' ignored in 1 record(s)" in w for w in warnings)


# ----------------------------------------------------------------------------- content


def test_content_parts_are_joined_as_templates_join_them(tmp_path) -> None:
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}]
    conv = only(tmp_path, {"messages": [{"role": "user", "content": parts}]})
    assert conv.messages == [{"role": "user", "content": "Hello world"}]


def test_an_audio_part_is_a_clear_error(tmp_path) -> None:
    audio = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
    parts = [{"type": "text", "text": "What is this?"}, audio]
    message = error(tmp_path, {"messages": [{"role": "user", "content": parts}]})
    assert message == (
        "messages[0].content[1].type: 'input_audio' part: audio and video prompts are not supported"
    )


def test_an_audio_field_is_a_clear_error(tmp_path) -> None:
    record = {"audio": "a.wav", "conversations": [{"from": "human", "value": "Transcribe."}]}
    assert error(tmp_path, record).startswith("audio: audio and video prompts are not supported")


def test_images_are_accepted(tmp_path) -> None:
    """The forms, skips and identity of images: tests/unit/test_prompt_images.py."""
    (tmp_path / "cat.png").write_bytes(CAT_PNG)
    record = {
        "image": "cat.png",
        "conversations": [{"from": "human", "value": "<image>\nWhat is this?"}],
    }
    (first, second) = only(tmp_path, record).messages[0]["content"]
    assert first == {"type": "image", "image": hashlib.sha256(CAT_PNG).hexdigest()}
    assert second == {"type": "text", "text": "\nWhat is this?"}


@pytest.mark.parametrize(
    ("record", "field"),
    [
        ({"messages": [{"role": "user", "content": "bad \ud800 text"}]}, "messages[0].content"),
        ({"id": "x\udfff", "messages": [{"role": "user", "content": "ok"}]}, "id"),
        ({"prompt": "ok", "system": "\ud800"}, "system"),
    ],
    ids=["content", "id", "system"],
)
def test_a_lone_surrogate_is_named_by_field(tmp_path, record, field) -> None:
    message = error(tmp_path, record)
    assert message.startswith(f"{field}: ") and "not valid Unicode" in message


# ----------------------------------------------------------------------------- tool calling

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


def tool_conversation(arguments: object) -> dict:
    return {
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "name": "weather", "content": "18C"},
            {"role": "assistant", "content": "It is 18C."},
        ],
    }


@pytest.mark.parametrize("arguments", ['{"city": "Paris"}', {"city": "Paris"}])
def test_tool_calls_tool_turns_and_tools_are_kept(tmp_path, arguments) -> None:
    conv = only(tmp_path, tool_conversation(arguments))
    assert conv.tools == TOOLS
    _, call, result, answer = conv.messages
    assert call == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
        ],
    }  # fmt: skip
    assert result == {"role": "tool", "content": "18C", "tool_call_id": "c1", "name": "weather"}
    assert answer == {"role": "assistant", "content": "It is 18C."}


def test_tools_as_a_json_string_are_decoded(tmp_path) -> None:
    record = {**tool_conversation("{}"), "tools": json.dumps(TOOLS)}
    assert only(tmp_path, record).tools == TOOLS


def test_tools_change_the_prompt_hash(tmp_path) -> None:
    conv = only(tmp_path, tool_conversation("{}"))
    assert conv.prompt_hash == prompt_hash(conv.messages, TOOLS) != prompt_hash(conv.messages)


def test_a_tool_turn_without_a_tool_call_before_it_is_rejected(tmp_path) -> None:
    record = {"messages": [*USER_ASSISTANT, {"role": "tool", "content": "x"}]}
    assert error(tmp_path, record).startswith("turn[2].role: expected 'user' here, got 'tool'")


# ----------------------------------------------------------------------------- duplicates


def test_same_prompt_with_another_reference_is_generated_once(tmp_path) -> None:
    path = jsonl(
        tmp_path,
        {"id": "a", "messages": USER_ASSISTANT},
        {"id": "b", "messages": [USER_ASSISTANT[0], {"role": "assistant", "content": "Other"}]},
    )
    result = read_prompts(path, on_invalid="error")
    assert [c.id for c in result.conversations] == ["a"]
    (skip,) = result.skipped
    assert (skip.line, skip.id) == (2, "b")
    assert skip.reason == "duplicate prompt (reference differs) of line 1"
    assert result.stats.duplicates == 1 and result.stats.invalid == 0
