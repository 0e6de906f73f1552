"""The bad-input corpus in tests/data/bad/: each file gets one clear line naming file,
line and field, or is accepted with a documented behaviour. With on_invalid=skip the
same record is listed with the same reason and the good records are kept."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.workflow import REPO

from eagle3data.prompts.sources import PromptFormatError, read_prompts

BAD = REPO / "tests" / "data" / "bad"

ERRORS = [
    ("malformed_json.jsonl", "sharegpt", 2, "(line): invalid JSON"),
    ("missing_field.jsonl", "sharegpt", 1, "conversations: missing field"),
    ("wrong_type.jsonl", "sharegpt", 1, "conversations[0].value: expected a string, got int"),
    ("unknown_role.jsonl", "sharegpt", 1, "conversations[1].from: unknown role 'bot'"),
    ("empty_content.jsonl", "sharegpt", 1, "conversations[0].value: empty text"),
    (
        "starts_with_assistant.jsonl",
        "sharegpt",
        1,
        "turn[0].role: expected 'user' here, got 'assistant'",
    ),
    ("duplicate_ids.jsonl", "sharegpt", 2, "id: duplicate id 'a' (first on line 1)"),
    ("non_utf8.jsonl", "sharegpt", 2, "(line): not UTF-8 text"),
    ("messages_unknown_role.jsonl", "messages", 1, "messages[1].role: unknown role 'robot'"),
    ("alpaca_missing_instruction.jsonl", "alpaca", 1, "instruction: missing field"),
    ("deeply_nested.jsonl", "sharegpt", 2, "(line): nested too deeply"),
    (
        "lone_surrogate.jsonl",
        "sharegpt",
        2,
        "conversations[0].value: lone surrogate \\ud800 at character 4: not valid Unicode text",
    ),
    ("multimodal_audio.jsonl", "auto", 2, "audio: audio and video prompts are not supported"),
]


@pytest.mark.parametrize(("name", "fmt", "line", "message"), ERRORS, ids=[e[0] for e in ERRORS])
def test_error_is_one_line_naming_file_line_and_field(name, fmt, line, message) -> None:
    path = BAD / name
    with pytest.raises(PromptFormatError) as info:
        read_prompts(path, fmt)
    text = str(info.value)
    assert text.startswith(f"{path}:{line}: {message}")
    assert "\n" not in text


@pytest.mark.parametrize(("name", "fmt", "line", "message"), ERRORS, ids=[e[0] for e in ERRORS])
def test_skip_policy_records_the_same_reason(name, fmt, line, message) -> None:
    result = read_prompts(BAD / name, fmt, on_invalid="skip")
    (skipped,) = result.skipped
    assert skipped.line == line and skipped.reason.startswith(message)
    # In every file with a bad second line, the first line is good and kept.
    assert [c.line for c in result.conversations] == ([1] if line == 2 else [])


def test_a_byte_order_mark_is_tolerated() -> None:
    (conv,) = read_prompts(BAD / "bom.jsonl").conversations
    assert conv.messages == [{"role": "user", "content": "Hello"}]


def test_a_repeated_key_keeps_the_last_value_and_is_counted() -> None:
    result = read_prompts(BAD / "duplicate_keys.jsonl")
    assert result.conversations[0].messages[0]["content"] == "second"
    (warning,) = result.stats.warnings()
    assert warning.startswith("1 record(s) repeat a JSON key; the last value was kept")
    assert "duplicate_keys.jsonl:1: conversations" in warning


def test_empty_file_is_an_empty_dataset() -> None:
    assert read_prompts(BAD / "empty.jsonl", "sharegpt").conversations == []


def test_missing_file_names_the_path() -> None:
    with pytest.raises(PromptFormatError, match=r"nope\.jsonl: prompt source not found"):
        read_prompts(BAD / "nope.jsonl", "sharegpt")


def test_a_final_assistant_turn_is_kept_as_reference_and_regenerated() -> None:
    (conv,) = read_prompts(BAD / "ends_with_assistant.jsonl", "sharegpt").conversations
    assert [m["role"] for m in conv.messages] == ["user", "assistant"]


def test_a_1mb_prompt_is_accepted_by_the_prompts_stage(tmp_path: Path) -> None:
    # Too long for most contexts: generation records it as a failed prompt with
    # the engine's reason ("prompt has N tokens; the model context is M", or the
    # server's 400), never a crash.
    text = "word " * 200_000
    path = tmp_path / "huge.jsonl"
    path.write_text(f'{{"prompt": "{text}"}}\n')
    (conv,) = read_prompts(path, "prompt").conversations
    assert len(conv.messages[0]["content"]) == 1_000_000
