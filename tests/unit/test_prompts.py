"""Prompt sources: formats, normalisation, ids, seeded order, and bad-input reporting."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3data.prompts.sources import (
    Conversation,
    PromptFormatError,
    conversation_hash_id,
    prompt_hash,
    read_prompts,
    seeded_order,
)


def write_jsonl(path: Path, records: list) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def sg(*turns: tuple[str, str], **extra) -> dict:
    return {**extra, "conversations": [{"from": f, "value": v} for f, v in turns]}


def msgs(*turns: tuple[str, str], **extra) -> dict:
    return {**extra, "messages": [{"role": r, "content": c} for r, c in turns]}


def _independent_hash(obj) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- formats


def test_sharegpt_normalises_roles_and_keeps_source_id(tmp_path):
    src = write_jsonl(
        tmp_path / "A1.jsonl",
        [
            sg(("system", "Be brief."), ("human", "Hi"), ("gpt", "Hello!"), id="c1"),
            sg(("human", "Q1"), ("gpt", "A1"), ("human", "Q2"), id="c2"),
        ],
    )
    res = read_prompts(src, "sharegpt")
    assert res.skipped == []
    assert [c.id for c in res.conversations] == ["c1", "c2"]
    assert res.conversations[0].messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ]
    assert res.conversations[1].messages == [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"},
    ]
    assert [c.line for c in res.conversations] == [1, 2]
    assert res.conversations[0].prompt_hash == prompt_hash(res.conversations[0].messages)


def test_messages_format(tmp_path):
    src = write_jsonl(
        tmp_path / "B1.jsonl",
        [
            {
                "id": "m1",
                "messages": [
                    {"role": "system", "content": "S", "name": "ignored"},
                    {"role": "user", "content": "U"},
                    {"role": "assistant", "content": "A"},
                ],
            }
        ],
    )
    (conv,) = read_prompts(src, "messages").conversations
    assert conv.id == "m1"
    assert conv.messages == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
    ]


def test_alpaca_format(tmp_path):
    src = write_jsonl(
        tmp_path / "al.jsonl",
        [
            {"instruction": "Translate", "input": "bonjour", "output": "hello"},
            {"instruction": "Say hi", "input": "", "output": ""},
            {"instruction": "Sum", "system": "You are a calculator.", "output": "2"},
        ],
    )
    convs = read_prompts(src, "alpaca").conversations
    assert [c.messages for c in convs] == [
        [
            {"role": "user", "content": "Translate\n\nbonjour"},
            {"role": "assistant", "content": "hello"},
        ],
        [{"role": "user", "content": "Say hi"}],
        [
            {"role": "system", "content": "You are a calculator."},
            {"role": "user", "content": "Sum"},
            {"role": "assistant", "content": "2"},
        ],
    ]
    assert all(c.id.startswith("h-") for c in convs)


def test_prompt_format(tmp_path):
    src = write_jsonl(
        tmp_path / "p.jsonl",
        [{"prompt": "Why is the sky blue?"}, {"prompt": "2+2?", "system": "Answer in digits."}],
    )
    convs = read_prompts(src, "prompt").conversations
    assert [c.messages for c in convs] == [
        [{"role": "user", "content": "Why is the sky blue?"}],
        [
            {"role": "system", "content": "Answer in digits."},
            {"role": "user", "content": "2+2?"},
        ],
    ]


def test_json_array_file_gives_the_same_as_jsonl(tmp_path):
    records = [sg(("human", "Q1"), id="x"), sg(("human", "Q2"), ("gpt", "A2"))]
    a = read_prompts(write_jsonl(tmp_path / "s.jsonl", records), "sharegpt")
    j = tmp_path / "s.json"
    j.write_text(json.dumps(records, indent=2), encoding="utf-8")
    b = read_prompts(j, "sharegpt")
    assert [(c.id, c.messages, c.prompt_hash) for c in a.conversations] == [
        (c.id, c.messages, c.prompt_hash) for c in b.conversations
    ]


def test_same_conversation_in_every_format_normalises_identically(tmp_path):
    sharegpt = sg(("system", "S"), ("human", "U"), ("gpt", "A"))
    messages = msgs(("system", "S"), ("user", "U"), ("assistant", "A"))
    alpaca = {"system": "S", "instruction": "U", "output": "A"}
    results = [
        read_prompts(write_jsonl(tmp_path / f"{fmt}.jsonl", [rec]), fmt).conversations[0]
        for fmt, rec in [("sharegpt", sharegpt), ("messages", messages), ("alpaca", alpaca)]
    ]
    assert len({json.dumps(c.messages) for c in results}) == 1
    assert len({c.id for c in results}) == 1
    assert len({c.prompt_hash for c in results}) == 1


def test_blank_lines_are_ignored_and_line_numbers_are_physical(tmp_path):
    src = tmp_path / "A1.jsonl"
    src.write_text(
        "\n" + json.dumps(sg(("human", "a"))) + "\n   \n" + json.dumps(sg(("human", "b"))) + "\n"
    )
    res = read_prompts(src, "sharegpt")
    assert [c.line for c in res.conversations] == [2, 4]


def test_last_line_without_newline_is_read(tmp_path):
    src = tmp_path / "A1.jsonl"
    src.write_text(json.dumps(sg(("human", "a"))) + "\n" + json.dumps(sg(("human", "b"))))
    assert len(read_prompts(src, "sharegpt").conversations) == 2


def test_integer_and_alternative_id_fields(tmp_path):
    src = write_jsonl(
        tmp_path / "A1.jsonl",
        [
            sg(("human", "a"), id=7),
            sg(("human", "b"), conversation_id="conv-b"),
            sg(("human", "c"), uuid="u-c"),
            sg(("human", "d"), id=None),
        ],
    )
    convs = read_prompts(src, "sharegpt").conversations
    assert [c.id for c in convs[:3]] == ["7", "conv-b", "u-c"]
    assert convs[3].id.startswith("h-")


# --------------------------------------------------------------------------- ids and hashes


def test_hash_id_is_a_pinned_content_hash():
    # Pinned values: changing them silently orphans every generation sidecar.
    assert conversation_hash_id([{"role": "user", "content": "Hello"}]) == "h-013cf0c05f083773"
    three = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hey"},
    ]
    assert conversation_hash_id(three) == "h-f5bbe02f43033662"
    assert prompt_hash(three) == "158ab9a5f9ffbe1e"
    assert conversation_hash_id(three) == "h-" + _independent_hash(three)


def test_prompt_hash_ignores_assistant_turns_but_not_system_or_user():
    base = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    other_answer = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "B"}]
    other_q = [{"role": "user", "content": "Q!"}, {"role": "assistant", "content": "A"}]
    with_sys = [{"role": "system", "content": "S"}, *base]
    assert prompt_hash(base) == prompt_hash(other_answer)
    assert prompt_hash(base) != prompt_hash(other_q)
    assert prompt_hash(base) != prompt_hash(with_sys)
    # the id of a conversation without source id does cover the assistant turns
    assert conversation_hash_id(base) != conversation_hash_id(other_answer)


def test_hash_id_independent_of_json_key_order(tmp_path):
    a = tmp_path / "a.jsonl"
    b = tmp_path / "b.jsonl"
    a.write_text(
        '{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]}\n'
    )
    b.write_text(
        '{"conversations": [{"value": "Hi", "from": "human"}, {"value": "Yo", "from": "gpt"}],'
        ' "extra": 1}\n'
    )
    (ca,) = read_prompts(a, "sharegpt").conversations
    (cb,) = read_prompts(b, "sharegpt").conversations
    assert ca.id == cb.id
    assert ca.id.startswith("h-")
    assert ca.id == conversation_hash_id(ca.messages)


def test_hash_id_stable_across_processes(tmp_path):
    src = write_jsonl(tmp_path / "A1.jsonl", [sg(("human", "Hi there"), ("gpt", "Hello"))])
    code = (
        "import sys; from eagle3data.prompts.sources import read_prompts; "
        "print(read_prompts(sys.argv[1], 'sharegpt').conversations[0].id)"
    )
    out = set()
    for hashseed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": hashseed}
        proc = subprocess.run(
            [sys.executable, "-c", code, str(src)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        out.add(proc.stdout.strip())
    (cid,) = out
    assert cid == read_prompts(src, "sharegpt").conversations[0].id


# --------------------------------------------------------------------------- seeded order


def _convs(names):
    return [
        Conversation(n, [{"role": "user", "content": n}], i, prompt_hash([]))
        for i, n in enumerate(names)
    ]


def test_seeded_order_is_deterministic_and_a_permutation():
    convs = _convs([f"id{i}" for i in range(50)])
    a = [c.id for c in seeded_order(convs, 1)]
    b = [c.id for c in seeded_order(list(convs), 1)]
    assert a == b
    assert sorted(a) == sorted(c.id for c in convs)
    assert a != [c.id for c in convs]  # it does shuffle


def test_seeded_order_independent_of_input_order():
    convs = _convs([f"id{i}" for i in range(50)])
    shuffled = list(convs)
    random.Random(3).shuffle(shuffled)
    assert [c.id for c in seeded_order(convs, 5)] == [c.id for c in seeded_order(shuffled, 5)]


def test_seeded_order_changes_with_the_seed():
    convs = _convs([f"id{i}" for i in range(50)])
    orders = {tuple(c.id for c in seeded_order(convs, seed)) for seed in range(5)}
    assert len(orders) == 5


def test_seeded_order_pinned():
    # Pinned: the order decides which prompts a budget buys; it must not drift.
    convs = _convs(["a", "b", "c", "d", "e"])
    order = [c.id for c in seeded_order(convs, 0)]
    expected = sorted("abcde", key=lambda i: hashlib.sha256(f"0\x00{i}".encode()).hexdigest())
    assert order == expected


def test_adding_prompts_keeps_relative_order_of_existing_ones(tmp_path):
    old = [sg(("human", f"question {i}")) for i in range(30)]
    new = old + [sg(("human", f"new question {i}")) for i in range(30)]
    random.Random(1).shuffle(new)  # appended anywhere in the source, in any order
    a = seeded_order(
        read_prompts(write_jsonl(tmp_path / "a.jsonl", old), "sharegpt").conversations, 42
    )
    b = seeded_order(
        read_prompts(write_jsonl(tmp_path / "b.jsonl", new), "sharegpt").conversations, 42
    )
    old_ids = [c.id for c in a]
    assert [c.id for c in b if c.id in set(old_ids)] == old_ids


# --------------------------------------------------------------------------- bad input

GOOD = sg(("human", "fine"), ("gpt", "ok"))

# (name, format, bad line content, expected message fragment after "<file>:<line>: ")
BAD_CASES = [
    ("invalid_json", "sharegpt", '{"conversations": [', "(line): invalid JSON"),
    ("non_object", "sharegpt", json.dumps([1, 2]), "(record): expected a JSON object, got list"),
    ("missing_conversations", "sharegpt", json.dumps({"id": "q"}), "conversations: missing field"),
    (
        "missing_from",
        "sharegpt",
        json.dumps({"conversations": [{"value": "x"}]}),
        "conversations[0].from: missing field",
    ),
    (
        "missing_value",
        "sharegpt",
        json.dumps({"conversations": [{"from": "human"}]}),
        "conversations[0].value: missing field",
    ),
    (
        "unknown_role_sharegpt",
        "sharegpt",
        json.dumps(sg(("human", "hi"), ("bot", "yo"))),
        "conversations[1].from: unknown role 'bot'",
    ),
    (
        "unknown_role_messages",
        "messages",
        json.dumps(msgs(("user", "hi"), ("robot", "yo"))),
        "messages[1].role: unknown role 'robot'",
    ),
    (
        "missing_content",
        "messages",
        json.dumps({"messages": [{"role": "user"}]}),
        "messages[0].content: missing field",
    ),
    (
        "empty_user_sharegpt",
        "sharegpt",
        json.dumps(sg(("human", "   "), ("gpt", "yo"))),
        "conversations[0].value: empty text",
    ),
    (
        "empty_user_messages",
        "messages",
        json.dumps(msgs(("user", ""))),
        "messages[0].content: empty text",
    ),
    (
        "non_string_content",
        "messages",
        json.dumps({"messages": [{"role": "user", "content": 5}]}),
        "messages[0].content: expected a string, got int",
    ),
    (
        "starts_with_assistant",
        "sharegpt",
        json.dumps(sg(("gpt", "hello"), ("human", "hi"))),
        "turn[0].role: expected 'user' here, got 'assistant'",
    ),
    (
        "starts_with_assistant_after_system",
        "messages",
        json.dumps(msgs(("system", "S"), ("assistant", "A"), ("user", "U"))),
        "turn[1].role: expected 'user' here, got 'assistant'",
    ),
    (
        "two_user_turns",
        "sharegpt",
        json.dumps(sg(("human", "a"), ("human", "b"))),
        "turn[1].role: expected 'assistant' here, got 'user'",
    ),
    (
        "system_in_the_middle",
        "messages",
        json.dumps(msgs(("user", "a"), ("system", "S"))),
        "turn[1].role: expected 'assistant' here, got 'system'",
    ),
    ("system_only", "messages", json.dumps(msgs(("system", "S"))), "messages: no user turn"),
    (
        "empty_list",
        "sharegpt",
        json.dumps({"conversations": []}),
        "conversations: expected a non-empty",
    ),
    (
        "alpaca_missing_instruction",
        "alpaca",
        json.dumps({"input": "x"}),
        "instruction: missing field",
    ),
    (
        "alpaca_empty_instruction",
        "alpaca",
        json.dumps({"instruction": " "}),
        "instruction: empty text",
    ),
    ("prompt_missing", "prompt", json.dumps({"system": "S"}), "prompt: missing field"),
    ("prompt_empty", "prompt", json.dumps({"prompt": ""}), "prompt: empty text"),
    (
        "bad_id_type",
        "prompt",
        json.dumps({"prompt": "x", "id": [1]}),
        "id: expected a string or integer id",
    ),
    ("empty_id", "prompt", json.dumps({"prompt": "x", "id": " "}), "id: empty id"),
]


def _good_for(fmt: str, text: str = "fine") -> dict:
    return {
        "sharegpt": GOOD if text == "fine" else sg(("human", text)),
        "messages": msgs(("user", text), ("assistant", "ok")),
        "alpaca": {"instruction": text, "output": "ok"},
        "prompt": {"prompt": text},
    }[fmt]


@pytest.mark.parametrize(
    ("name", "fmt", "line", "fragment"), BAD_CASES, ids=[c[0] for c in BAD_CASES]
)
def test_bad_record_error_names_file_line_and_field(tmp_path, name, fmt, line, fragment):
    good = _good_for(fmt)
    other = _good_for(fmt, "fine 2")
    src = write_jsonl(tmp_path / "A1.jsonl", [good, other, line])
    with pytest.raises(PromptFormatError) as exc:
        read_prompts(src, fmt)
    msg = str(exc.value)
    assert msg.startswith(f"{src}:3: "), msg
    assert f"A1.jsonl:3: {fragment}" in msg


@pytest.mark.parametrize(
    ("name", "fmt", "line", "fragment"), BAD_CASES, ids=[c[0] for c in BAD_CASES]
)
def test_bad_record_skipped_with_line_and_reason(tmp_path, name, fmt, line, fragment):
    good = _good_for(fmt)
    other = _good_for(fmt, "fine 2")
    src = write_jsonl(tmp_path / "A1.jsonl", [good, line, other])
    res = read_prompts(src, fmt, on_invalid="skip")
    assert [c.line for c in res.conversations] == [1, 3]
    (skip,) = res.skipped
    assert skip.line == 2
    assert skip.file == str(src)
    assert skip.reason.startswith(fragment), skip.reason
    row = skip.as_row()
    assert row["line"] == 2 and row["file"] == str(src) and row["reason"] == skip.reason


def test_unknown_role_message_matches_documented_example(tmp_path):
    src = write_jsonl(
        tmp_path / "A1.jsonl",
        [GOOD, sg(("human", "x"), id="b"), sg(("human", "hi"), ("bot", "yo"))],
    )
    with pytest.raises(
        PromptFormatError, match=r"A1\.jsonl:3: conversations\[1\]\.from: unknown role 'bot'"
    ):
        read_prompts(src, "sharegpt")


def test_non_utf8_line_error_and_skip(tmp_path):
    src = tmp_path / "A1.jsonl"
    src.write_bytes(
        (json.dumps(GOOD) + "\n").encode()
        + b'{"conversations": [{"from": "human", "value": "caf\xe9"}]}\n'
        + (json.dumps(sg(("human", "after"))) + "\n").encode()
    )
    with pytest.raises(PromptFormatError) as exc:
        read_prompts(src, "sharegpt")
    assert str(exc.value).startswith(f"{src}:2: ")
    assert "not UTF-8" in str(exc.value)
    res = read_prompts(src, "sharegpt", on_invalid="skip")
    assert [c.line for c in res.conversations] == [1, 3]
    (skip,) = res.skipped
    assert skip.line == 2 and "not UTF-8" in skip.reason


def test_non_utf8_json_file_names_the_file(tmp_path):
    src = tmp_path / "A1.json"
    src.write_bytes(b'[{"prompt": "caf\xe9"}]')
    with pytest.raises(PromptFormatError, match=r"A1\.json.*not UTF-8"):
        read_prompts(src, "prompt")


def test_invalid_json_file_names_file_and_line(tmp_path):
    src = tmp_path / "A1.json"
    src.write_text('[\n  {"prompt": "a"},\n  {"prompt": \n]\n')
    with pytest.raises(PromptFormatError) as exc:
        read_prompts(src, "prompt")
    assert str(exc.value).startswith(f"{src}: line 4, column 1: record 2: invalid JSON")


def test_json_file_must_hold_an_array(tmp_path):
    src = tmp_path / "A1.json"
    src.write_text(json.dumps({"data": [{"prompt": "a"}]}, indent=2))
    with pytest.raises(PromptFormatError) as info:
        read_prompts(src, "prompt")
    assert str(info.value).startswith(f"{src}: one JSON object, not records")
    assert "the list under 'data'" in str(info.value)


def test_json_array_bad_record_is_numbered(tmp_path):
    src = tmp_path / "A1.json"
    src.write_text(json.dumps([{"prompt": "a"}, {"prompt": "b"}, {"system": "s"}]))
    expected = r"A1\.json record 3 \(line 1\): prompt: missing field"
    with pytest.raises(PromptFormatError, match=expected):
        read_prompts(src, "prompt")
    res = read_prompts(src, "prompt", on_invalid="skip")
    assert len(res.conversations) == 2
    assert (res.skipped[0].record, res.skipped[0].line) == (3, 1)


def test_duplicate_source_id_with_different_content(tmp_path):
    src = write_jsonl(
        tmp_path / "A1.jsonl",
        [
            sg(("human", "one"), id="x"),
            sg(("human", "two"), id="y"),
            sg(("human", "other"), id="x"),
        ],
    )
    with pytest.raises(PromptFormatError) as exc:
        read_prompts(src, "sharegpt")
    msg = str(exc.value)
    assert msg.startswith(f"{src}:3: id: duplicate id 'x'")
    assert "line 1" in msg
    res = read_prompts(src, "sharegpt", on_invalid="skip")
    assert [c.id for c in res.conversations] == ["x", "y"]
    assert res.conversations[0].messages[0]["content"] == "one"  # first wins
    (skip,) = res.skipped
    assert skip.line == 3 and skip.id == "x" and "duplicate id" in skip.reason


@pytest.mark.parametrize("on_invalid", ["error", "skip"])
def test_exact_duplicate_conversation_always_skipped(tmp_path, on_invalid):
    src = tmp_path / "A1.jsonl"
    src.write_text(
        '{"conversations": [{"from": "human", "value": "Hi"}]}\n'
        '{"conversations": [{"from": "human", "value": "Other"}]}\n'
        '{"conversations": [{"value": "Hi", "from": "human"}]}\n'  # same, other key order
        '{"id": "s", "conversations": [{"from": "human", "value": "S"}]}\n'
        '{"id": "s", "conversations": [{"from": "human", "value": "S"}]}\n'
    )
    res = read_prompts(src, "sharegpt", on_invalid=on_invalid)
    assert [c.line for c in res.conversations] == [1, 2, 4]
    assert [(s.line, s.reason) for s in res.skipped] == [
        (3, "duplicate of line 1"),
        (5, "duplicate of line 4"),
    ]
    assert res.skipped[0].id == res.conversations[0].id
    assert res.skipped[1].id == "s"


def test_exact_duplicate_conversation_under_another_source_id_is_skipped(tmp_path):
    """The module promises 'Exact duplicate conversations are always dropped and recorded
    (keeping the first): regenerating them twice buys nothing' -- also when the source
    gave the copies different ids (common in scraped ShareGPT dumps)."""
    src = write_jsonl(
        tmp_path / "A1.jsonl",
        [sg(("human", "Hi"), ("gpt", "Yo"), id="a"), sg(("human", "Hi"), ("gpt", "Yo"), id="b")],
    )
    res = read_prompts(src, "sharegpt")
    assert [c.id for c in res.conversations] == ["a"]
    assert [(s.line, s.reason) for s in res.skipped] == [(2, "duplicate of line 1")]


def test_skip_mode_keeps_good_records_among_many_bad(tmp_path):
    src = tmp_path / "A1.jsonl"
    src.write_bytes(
        b"\n".join(
            [
                json.dumps(sg(("human", "g1"))).encode(),
                b"not json",
                json.dumps(sg(("human", "g2"), ("bot", "x"))).encode(),
                b"\xff\xfe",
                json.dumps(sg(("human", "g3"))).encode(),
                b"42",
                json.dumps(sg(("human", "g1"))).encode(),
            ]
        )
        + b"\n"
    )
    res = read_prompts(src, "sharegpt", on_invalid="skip")
    assert [c.messages[0]["content"] for c in res.conversations] == ["g1", "g3"]
    assert [c.line for c in res.conversations] == [1, 5]
    assert [s.line for s in res.skipped] == [2, 3, 4, 6, 7]
    reasons = [s.reason for s in res.skipped]
    assert reasons[0].startswith("(line): invalid JSON")
    assert reasons[1].startswith("conversations[1].from: unknown role 'bot'")
    assert reasons[2].startswith("(line): not UTF-8")
    assert reasons[3].startswith("(record): expected a JSON object, got int")
    assert reasons[4] == "duplicate of line 1"


def test_error_mode_reports_the_first_bad_line(tmp_path):
    src = write_jsonl(tmp_path / "A1.jsonl", [GOOD, "nope", "[]"])
    with pytest.raises(PromptFormatError, match=r"A1\.jsonl:2: "):
        read_prompts(src, "sharegpt")


# --------------------------------------------------------------------------- files


def test_empty_files_give_zero_conversations(tmp_path):
    (tmp_path / "e.jsonl").write_bytes(b"")
    (tmp_path / "w.jsonl").write_text("\n\n  \n")
    (tmp_path / "e.json").write_text("[]")
    for name in ("e.jsonl", "w.jsonl", "e.json"):
        res = read_prompts(tmp_path / name, "sharegpt")
        assert res.conversations == [] and res.skipped == []


def test_missing_file_raises_with_path(tmp_path):
    missing = tmp_path / "nope" / "A1.jsonl"
    with pytest.raises(PromptFormatError, match="not found") as exc:
        read_prompts(missing, "sharegpt")
    assert str(missing) in str(exc.value)


def test_unknown_format_raises_with_path(tmp_path):
    src = write_jsonl(tmp_path / "A1.jsonl", [GOOD])
    with pytest.raises(PromptFormatError, match="unknown format 'csv'") as exc:
        read_prompts(src, "csv")
    assert str(src) in str(exc.value)


def test_prompt_format_error_is_a_value_error():
    assert issubclass(PromptFormatError, ValueError)
