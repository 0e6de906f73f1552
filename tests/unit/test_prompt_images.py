"""Image prompts: every input form gives the same parts and hash, images are part of a
prompt's identity, an unreadable image is a recorded skip, the image table round-trips,
and text-only datasets come out exactly as before images."""

from __future__ import annotations

import hashlib
import io
import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from eagle3data.images import (
    IMAGE_SCHEMA,
    ImageError,
    ImageTable,
    ImageTableWriter,
    content_text,
    data_uri,
    decode_image,
    has_images,
    image_part,
    load_image,
    message_images,
    parse_data_uri,
    text_part,
)
from eagle3data.prompts import stage
from eagle3data.prompts.sources import (
    PromptFormatError,
    conversation_hash_id,
    prompt_hash,
    read_prompts,
)
from eagle3data.prompts.table import iter_prompts

QUESTION = "What is this?"


def image_bytes(color: tuple[int, int, int], size: tuple[int, int] = (3, 2), fmt="PNG") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format=fmt)
    return buffer.getvalue()


RED = image_bytes((255, 0, 0))
BLUE = image_bytes((0, 0, 255))
RED_SHA = hashlib.sha256(RED).hexdigest()
BLUE_SHA = hashlib.sha256(BLUE).hexdigest()


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def jsonl(path: Path, *records: object) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def user(*parts: object) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": list(parts)}]}


def text(value: str) -> dict[str, str]:
    return {"type": "text", "text": value}


# ----------------------------------------------------------------------------- forms

# Each makes one record naming the red image (cat.png beside the data file) and asking
# QUESTION after it.
FORMS = {
    "openai relative path": lambda d: user(
        {"type": "image_url", "image_url": {"url": "cat.png", "detail": "high"}}, text(QUESTION)
    ),
    "openai bare absolute path": lambda d: user(
        {"type": "image_url", "image_url": str(d / "cat.png")}, text(QUESTION)
    ),
    "openai file url": lambda d: user(
        {"type": "image_url", "image_url": {"url": (d / "cat.png").as_uri()}}, text(QUESTION)
    ),
    "openai data uri": lambda d: user(
        {"type": "image_url", "image_url": {"url": data_uri(RED, "image/png")}}, text(QUESTION)
    ),
    "responses input_image": lambda d: user(
        {"type": "input_image", "image_url": "cat.png"}, {"type": "input_text", "text": QUESTION}
    ),
    "hf image path": lambda d: user({"type": "image", "image": "cat.png"}, text(QUESTION)),
    "hf image data uri": lambda d: user(
        {"type": "image", "image": data_uri(RED, "image/png")}, text(QUESTION)
    ),
    "hf placeholder and images": lambda d: {
        **user({"type": "image"}, text(QUESTION)),
        "images": ["cat.png"],
    },
    "sharegpt marker": lambda d: {
        "image": "cat.png",
        "conversations": [{"from": "human", "value": f"<image>{QUESTION}"}],
    },
    "llava without marker": lambda d: {
        "images": ["cat.png"],
        "conversations": [{"from": "human", "value": QUESTION}],
    },
    "alpaca marker": lambda d: {"image": "cat.png", "instruction": f"<image>{QUESTION}"},
}


@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
def test_every_input_form_gives_the_same_parts_and_hash(tmp_path, form) -> None:
    write(tmp_path / "cat.png", RED)
    (conv,) = read_prompts(jsonl(tmp_path / "a.jsonl", form(tmp_path))).conversations
    assert conv.messages == [
        {"role": "user", "content": [image_part(RED_SHA), text_part(QUESTION)]}
    ]
    assert conv.prompt_hash == prompt_hash(conv.messages)
    assert [(i.sha256, i.mime, i.width, i.height, i.data) for i in conv.images] == [
        (RED_SHA, "image/png", 3, 2, RED)
    ]


def test_markers_take_the_images_in_order_across_user_turns(tmp_path) -> None:
    write(tmp_path / "imgs" / "a.png", RED)
    write(tmp_path / "imgs" / "b.png", BLUE)
    record = {
        "images": ["imgs/a.png", "imgs/b.png"],
        "conversations": [
            {"from": "human", "value": "Look: <image> and"},
            {"from": "gpt", "value": "Red."},
            {"from": "human", "value": "now <image>"},
        ],
    }
    (conv,) = read_prompts(jsonl(tmp_path / "a.jsonl", record)).conversations
    assert conv.messages == [
        {"role": "user", "content": [text_part("Look: "), image_part(RED_SHA), text_part(" and")]},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": [text_part("now "), image_part(BLUE_SHA)]},
    ]
    assert message_images(conv.messages) == [RED_SHA, BLUE_SHA]


def test_the_same_image_twice_is_stored_once(tmp_path) -> None:
    write(tmp_path / "cat.png", RED)
    record = user(
        {"type": "image", "image": "cat.png"},
        text("vs"),
        {"type": "image_url", "image_url": "cat.png"},
    )
    (conv,) = read_prompts(jsonl(tmp_path / "a.jsonl", record)).conversations
    assert message_images(conv.messages) == [RED_SHA, RED_SHA]
    assert [i.sha256 for i in conv.images] == [RED_SHA]


@pytest.mark.parametrize(
    ("images", "value", "message"),
    [
        (
            ["a.png"],
            "<image> <image>",
            "images: 2 image place(s) (<image> markers) in the turns but 1",
        ),
        (
            ["a.png", "a.png"],
            "<image> x",
            "images: 1 image place(s) (<image> markers) in the turns but 2",
        ),
    ],
    ids=["more-markers", "images-left-over"],
)
def test_markers_and_images_must_match(tmp_path, images, value, message) -> None:
    write(tmp_path / "a.png", RED)
    path = jsonl(
        tmp_path / "a.jsonl",
        {"images": images, "conversations": [{"from": "human", "value": value}]},
    )
    with pytest.raises(PromptFormatError, match="^" + re.escape(f"{path}:1: {message}")):
        read_prompts(path)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (
            {
                "messages": [
                    {"role": "system", "content": [{"type": "image", "image": "a.png"}]},
                    {"role": "user", "content": "Hi"},
                ]
            },
            "messages[0].content[0].type: an image in a system turn: "
            "only user turns may carry images",
        ),
        (
            {
                "image": "a.png",
                "conversations": [
                    {"from": "human", "value": "Hi"},
                    {"from": "gpt", "value": "<image>"},
                ],
            },
            "turn[1].content: <image> in a assistant turn: only user turns may carry images",
        ),
        (
            user({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}),
            "messages[0].content[0].type: 'input_audio' part: "
            "audio and video prompts are not supported",
        ),
        (
            {"video": "clip.mp4", "messages": [{"role": "user", "content": "Hi"}]},
            "video: audio and video prompts are not supported (the record carries video data)",
        ),
        (user({"type": "image"}), "messages[0].content[0]: an image part without an image"),
    ],
    ids=["system-image-part", "assistant-marker", "audio-part", "video-field", "no-image"],
)
def test_record_problems_name_the_field(tmp_path, record, message) -> None:
    write(tmp_path / "a.png", RED)
    path = jsonl(tmp_path / "a.jsonl", record)
    with pytest.raises(PromptFormatError) as info:
        read_prompts(path)
    assert str(info.value).startswith(f"{path}:1: {message}")


# ----------------------------------------------------------------------------- identity


def test_the_image_is_part_of_the_prompts_identity(tmp_path) -> None:
    write(tmp_path / "red.png", RED)
    write(tmp_path / "blue.png", BLUE)
    write(tmp_path / "copy-of-red.png", RED)
    path = jsonl(
        tmp_path / "a.jsonl",
        *(
            {"image": name, "conversations": [{"from": "human", "value": QUESTION}]}
            for name in ("red.png", "blue.png", "copy-of-red.png")
        ),
    )
    result = read_prompts(path)
    red, blue = result.conversations
    assert red.prompt_hash != blue.prompt_hash and red.id != blue.id
    assert red.id == conversation_hash_id(red.messages)
    (duplicate,) = result.skipped
    assert (duplicate.line, duplicate.reason) == (3, "duplicate of line 1")


# ----------------------------------------------------------------------------- skips


def unreadable_sources(tmp_path: Path) -> Path:
    write(tmp_path / "cat.png", RED)
    gradient = Image.linear_gradient("L").resize((32, 32))
    buffer = io.BytesIO()
    gradient.save(buffer, format="PNG")
    png = buffer.getvalue()
    write(tmp_path / "broken.png", png[: len(png) // 2])  # the header reads, the data does not
    return jsonl(
        tmp_path / "a.jsonl",
        user({"type": "image_url", "image_url": {"url": "cat.png"}}, text("ok")),
        user(text("first"), {"type": "image_url", "image_url": {"url": "missing.png"}}),
        {"image": "broken.png", "conversations": [{"from": "human", "value": "<image>"}]},
        user({"type": "image", "image": "data:image/png;base64,not*base64"}),
        user({"type": "image", "image": "cat.png"}, text("also ok")),
    )


@pytest.mark.parametrize("on_invalid", ["error", "skip"])
def test_an_unreadable_image_is_a_recorded_skip_whatever_on_invalid_says(
    tmp_path, on_invalid
) -> None:
    path = unreadable_sources(tmp_path)
    result = read_prompts(path, on_invalid=on_invalid)
    assert [c.line for c in result.conversations] == [1, 5]
    skips = [(s.file, s.line, s.reason) for s in result.skipped]
    assert [(file, line) for file, line, _ in skips] == [
        (str(path), 2),
        (str(path), 3),
        (str(path), 4),
    ]
    missing, broken, bad_uri = (reason for _, _, reason in skips)
    assert missing == (
        "messages[0].content[1].image_url.url: cannot read image 'missing.png' "
        "(No such file or directory)"
    )
    assert broken.startswith("image: cannot read image 'broken.png' (")
    assert bad_uri.startswith("messages[0].content[0].image: malformed data URI (bad base64")
    assert result.stats.unreadable_images == 3 and result.stats.invalid == 0


def test_an_http_url_is_a_record_problem(tmp_path) -> None:
    url = "https://example.com/cat.png"
    path = jsonl(
        tmp_path / "a.jsonl",
        user(text("kept")),
        user({"type": "image_url", "image_url": {"url": url}}),
    )
    with pytest.raises(PromptFormatError) as info:
        read_prompts(path)
    assert str(info.value) == (
        f"{path}:2: messages[0].content[0].image_url.url: image URL {url!r}: images are not "
        "downloaded; download them and give a local path or a data URI"
    )
    result = read_prompts(path, on_invalid="skip")
    assert [c.line for c in result.conversations] == [1] and result.stats.invalid == 1


# ----------------------------------------------------------------------------- parquet

HF_IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
SHAREGPT_TURNS = pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())]))


def test_parquet_image_columns_as_the_hub_ships_them(tmp_path) -> None:
    write(tmp_path / "data" / "imgs" / "blue.png", BLUE)
    turns = [[{"from": "human", "value": f"<image>{QUESTION} {i}"}] for i in range(3)]
    images = [{"bytes": RED, "path": "ignored.png"}, {"bytes": None, "path": "imgs/blue.png"}, None]
    table = pa.table(
        {"conversations": pa.array(turns, SHAREGPT_TURNS), "image": pa.array(images, HF_IMAGE)}
    )
    pq.write_table(table, tmp_path / "data" / "train.parquet")
    result = read_prompts(tmp_path / "data")
    contents = [c.messages[0]["content"] for c in result.conversations]
    assert contents == [
        [image_part(RED_SHA), text_part(f"{QUESTION} 0")],
        [image_part(BLUE_SHA), text_part(f"{QUESTION} 1")],
        f"<image>{QUESTION} 2",  # no image: the text is the text
    ]
    assert result.skipped == [] and result.stats.warnings() == []


def test_parquet_messages_with_image_places_and_an_images_column(tmp_path) -> None:
    """TRL's vision datasets: ``{"type": "image"}`` parts and a list of ``datasets.Image``."""
    part = pa.struct([("type", pa.string()), ("text", pa.string())])
    message = pa.struct([("role", pa.string()), ("content", pa.list_(part))])
    messages = [
        [
            {
                "role": "user",
                "content": [
                    {"type": "image", "text": None},
                    {"type": "text", "text": "Compare"},
                    {"type": "image", "text": None},
                ],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "Same hue? No."}]},
        ]
    ]
    images = [[{"bytes": RED, "path": None}, {"bytes": BLUE, "path": None}]]
    table = pa.table(
        {
            "messages": pa.array(messages, pa.list_(message)),
            "images": pa.array(images, pa.list_(HF_IMAGE)),
        }
    )
    pq.write_table(table, tmp_path / "train.parquet")
    (conv,) = read_prompts(tmp_path / "train.parquet").conversations
    assert conv.messages == [
        {
            "role": "user",
            "content": [image_part(RED_SHA), text_part("Compare"), image_part(BLUE_SHA)],
        },
        {"role": "assistant", "content": "Same hue? No."},
    ]


# ----------------------------------------------------------------------------- the stage


def run_stage(tmp_path: Path, source: Path, **kwargs: Any) -> dict[str, Path]:
    out = {
        name: tmp_path / "out" / f"A1.{name}"
        for name in ("parquet", "skipped.jsonl", "images.parquet")
    }
    stage.prepare_prompts(
        dataset="A1",
        source=str(source),
        on_invalid=kwargs.pop("on_invalid", "skip"),
        shuffle_seed=kwargs.pop("shuffle_seed", 7),
        out_prompts=str(out["parquet"]),
        out_skipped=str(out["skipped.jsonl"]),
        out_images=str(out["images.parquet"]),
        **kwargs,
    )
    return out


def test_the_stage_writes_the_images_of_the_kept_conversations(tmp_path) -> None:
    jpeg = image_bytes((0, 200, 0), size=(5, 4), fmt="JPEG")
    green_sha = hashlib.sha256(jpeg).hexdigest()
    write(tmp_path / "red.png", RED)
    write(tmp_path / "blue.png", BLUE)
    write(tmp_path / "green.jpg", jpeg)
    write(tmp_path / "only-in-a-bad-record.png", image_bytes((9, 9, 9)))
    source = jsonl(
        tmp_path / "a.jsonl",
        {"image": "blue.png", "conversations": [{"from": "human", "value": "one"}]},
        {"image": "blue.png", "conversations": [{"from": "human", "value": "one"}]},  # duplicate
        {"image": "missing.png", "conversations": [{"from": "human", "value": "two"}]},
        {
            "images": ["green.jpg", "red.png"],
            "conversations": [{"from": "human", "value": "<image><image>three"}],
        },
        {"image": "only-in-a-bad-record.png", "conversations": [{"from": "bot", "value": "x"}]},
    )
    out = run_stage(tmp_path, source)
    with ImageTable(out["images.parquet"]) as table:
        assert list(table) == [BLUE_SHA, green_sha, RED_SHA] and len(table) == 3
        assert table.get(green_sha) == jpeg and table.get(RED_SHA) == RED
        green = table.info(green_sha)
        assert (green.mime, green.width, green.height) == ("image/jpeg", 5, 4)
        assert "f" * 64 not in table
    expected = read_prompts(source, on_invalid="skip").conversations
    rows = list(iter_prompts(out["parquet"]))
    assert sorted((r["id"], r["prompt_hash"]) for r in rows) == sorted(
        (c.id, c.prompt_hash) for c in expected
    )
    by_line = {r["source_line"]: r for r in rows}
    assert by_line[4]["messages"] == [
        {
            "role": "user",
            "content": [image_part(green_sha), image_part(RED_SHA), text_part("three")],
        }
    ]
    stored = pq.read_table(out["parquet"]).to_pylist()
    stored_four = next(r for r in stored if r["source_line"] == 4)["messages"][0]
    assert stored_four["content"] == "three"  # the text, for readers of text alone
    reasons = [json.loads(line)["reason"] for line in out["skipped.jsonl"].read_text().splitlines()]
    assert [r.split(":")[0] for r in reasons] == [
        "duplicate of line 1",
        "image",
        "conversations[0].from",
    ]


def test_a_dataset_whose_images_are_all_missing_fails_the_stage(tmp_path) -> None:
    source = jsonl(
        tmp_path / "a.jsonl",
        *(
            {"image": f"{i}.png", "conversations": [{"from": "human", "value": "q"}]}
            for i in range(2)
        ),
    )
    with pytest.raises(PromptFormatError) as info:
        run_stage(tmp_path, source, on_invalid="error")
    assert "only 0 of 2 records are valid (0%)" in str(info.value)
    assert "most common problems: image (2)" in str(info.value)
    assert not (tmp_path / "out" / "A1.images.parquet").exists()


def test_helpers_read_parts(tmp_path) -> None:
    parts = [text_part("a"), image_part(RED_SHA), text_part("b")]
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": parts}]
    assert content_text(parts) == "ab" and content_text("plain") == "plain"
    assert message_images(messages) == [RED_SHA] and has_images(messages)
    assert not has_images([{"role": "user", "content": "plain"}])


def test_data_uris_and_decoding() -> None:
    assert parse_data_uri(data_uri(RED, "image/png")) == RED
    assert parse_data_uri("data:,a%20b") == b"a b"
    for bad in ("data:image/png;base64", "data:image/png;base64,@@", "http://x"):
        with pytest.raises(ImageError, match="malformed data URI"):
            parse_data_uri(bad)
    assert decode_image(image_bytes((1, 2, 3), (7, 5), "JPEG"), "x") == ("image/jpeg", 7, 5)
    with pytest.raises(ImageError) as info:
        decode_image(b"not an image", "'x.png'")
    assert str(info.value) == "cannot read image 'x.png' (not an image format Pillow reads)"


# ----------------------------------------------------------------------------- the table


def test_the_image_table_round_trips_over_many_row_groups(tmp_path) -> None:
    images = [load_image(image_bytes((i, 0, 0), (1 + i % 4, 2)), "test") for i in range(150)]
    path = tmp_path / "t.images.parquet"
    with ImageTableWriter(path) as writer:
        added = [writer.add(image) for image in [*images, *images[:10]]]
    assert added == [True] * 150 + [False] * 10
    assert pq.ParquetFile(path).metadata.num_row_groups > 1
    with ImageTable(path) as table:
        assert list(table) == [i.sha256 for i in images]
        for image in reversed(images):
            assert table.get(image.sha256) == image.data
            info = table.info(image.sha256)
            assert (info.mime, info.width, info.height) == ("image/png", image.width, 2)


def test_an_empty_image_table_and_an_aborted_one(tmp_path) -> None:
    with ImageTableWriter(tmp_path / "empty.parquet"):
        pass
    assert pq.read_schema(tmp_path / "empty.parquet").equals(IMAGE_SCHEMA)
    with ImageTable(tmp_path / "empty.parquet") as table:
        assert len(table) == 0 and RED_SHA not in table
        with pytest.raises(KeyError, match="no image with sha256"):
            table.get(RED_SHA)
    with pytest.raises(RuntimeError), ImageTableWriter(tmp_path / "aborted.parquet") as writer:
        writer.add(load_image(RED, "red"))
        raise RuntimeError
    assert list(tmp_path.iterdir()) == [tmp_path / "empty.parquet"]


# ----------------------------------------------------------------------------- text only

# A text-only source and what the stage wrote for it before images existed (at e1fb151):
# the rows' digest (source_file by name) and the skips, byte for byte.
TEXT_ONLY = [
    {
        "id": "s1",
        "conversations": [
            {"from": "human", "value": "Hi <image> there"},
            {"from": "gpt", "value": "Yo"},
        ],
    },
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}],
            },
        ]
    },
    {"instruction": "Summarise.", "input": "Long text.", "output": "Short."},
    {"prompt": "Why?", "system": "Answer."},
    {
        "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        ],
        "messages": [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "content": "done", "tool_call_id": "c"},
        ],
    },
    {
        "id": "s1b",
        "conversations": [
            {"from": "human", "value": "Hi <image> there"},
            {"from": "gpt", "value": "Other"},
        ],
    },
    {"messages": [{"role": "bot", "content": "x"}]},
]
TEXT_ONLY_ROWS_SHA256 = "5548ed3a3ca42f9f2ebb607eb40364598737a3d2710bf3368c88fefd75f125e9"
TEXT_ONLY_ORDER = [
    ("h-64b8e8f04d26034b", "b660ecc070593aba"),
    ("h-cf9e0a2c8fb2d0fc", "cf9e0a2c8fb2d0fc"),
    ("h-29714758268a5fc7", "3f8d4626d70cbaec"),
    ("h-9248dbae05df2832", "9248dbae05df2832"),
    ("s1", "bfd02696350ee1e1"),
]
TEXT_ONLY_SKIPPED = (
    '{"file":"<d>/text.jsonl","id":"s1b","line":6,"reason":"duplicate prompt (reference differs) '
    'of line 1","record":6}\n'
    '{"file":"<d>/text.jsonl","id":null,"line":7,"reason":"messages[0].role: unknown role '
    "'bot' (expected one of ['assistant', 'bard', 'bing', 'chatgpt', 'function', 'gpt', "
    "'human', 'model', 'system', 'tool', 'user']; map others with "
    'datasets.NAME.fields.roles)","record":7}\n'
)


def test_text_only_datasets_give_the_same_rows_as_before_images(tmp_path) -> None:
    source = jsonl(tmp_path / "text.jsonl", *TEXT_ONLY)
    out = run_stage(tmp_path, source, shuffle_seed=3)
    rows = pq.read_table(out["parquet"]).to_pylist()
    assert [(r["id"], r["prompt_hash"]) for r in rows] == TEXT_ONLY_ORDER
    for row in rows:
        row["source_file"] = Path(row["source_file"]).name
        for message in row["messages"]:
            assert message.pop("parts") is None  # the one change: a column, null for text
    digest = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()
    assert digest == TEXT_ONLY_ROWS_SHA256
    assert out["skipped.jsonl"].read_text().replace(str(tmp_path), "<d>") == TEXT_ONLY_SKIPPED
    with ImageTable(out["images.parquet"]) as table:
        assert len(table) == 0
