"""Image parts on their way to an engine: checked as template input, and sent to an
OpenAI-compatible server (SGLang, vLLM) as an ``image_url`` part holding a data URI."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from eagle3data.chat_messages import validated
from eagle3data.errors import ChatTemplateError
from eagle3data.images import data_uri, image_part, load_image, text_part
from eagle3data.servers.openai_chat import request_body

SAMPLING = {"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "top_k": -1}
SAMPLING |= {"repetition_penalty": 1.0, "stop": []}


def png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(buffer, "PNG")
    return buffer.getvalue()


def body(messages: list[dict], image_url=None) -> dict:
    return request_body(
        messages,
        model="m",
        sampling=SAMPLING,
        seed=0,
        chat_template_kwargs={},
        extra_body={},
        image_url=image_url,
    )


def test_an_image_part_is_sent_as_a_data_uri_in_place() -> None:
    image = load_image(png(), "test")
    messages = [{"role": "user", "content": [text_part("Look: "), image_part(image.sha256)]}]
    sent = body(messages, lambda sha: data_uri(png(), "image/png") if sha == image.sha256 else "")
    (content,) = [m["content"] for m in sent["messages"]]
    assert content[0] == {"type": "text", "text": "Look: "}
    assert content[1]["type"] == "image_url"
    url = content[1]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    assert base64.b64decode(url.split(",", 1)[1]) == png()
    assert messages[0]["content"][1] == image_part(image.sha256)  # the row keeps its hash


def test_text_messages_are_sent_as_before() -> None:
    messages = [{"role": "user", "content": "Hi"}]
    assert body(messages)["messages"] == messages


def test_an_image_part_without_an_image_table_is_refused() -> None:
    messages = [{"role": "user", "content": [image_part("0" * 64)]}]
    with pytest.raises(ValueError, match="no image table"):
        body(messages)


def test_only_user_turns_hold_parts_and_only_text_and_image_ones() -> None:
    parts = [text_part("What is it?"), image_part("a" * 64)]
    assert validated([{"role": "user", "content": parts}])[0]["content"] == parts
    with pytest.raises(ChatTemplateError, match=r"turn 1 \(assistant\): content must be a string"):
        validated([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": parts}])
    audio = [{"type": "input_audio", "input_audio": {}}]
    with pytest.raises(ChatTemplateError, match=r"content\[0\] must be a text or an image part"):
        validated([{"role": "user", "content": audio}])
