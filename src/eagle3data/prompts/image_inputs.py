"""Images in prompt records: the forms a record names them in, read at ingest.

* content parts: OpenAI ``{"type": "image_url", "image_url": {"url": U}}`` (or ``U``
  bare), the Responses API's ``{"type": "input_image", "image_url": U}``, and Hugging
  Face's ``{"type": "image", "image": X}`` (``url`` or ``path`` for ``image`` too);
* ShareGPT/LLaVA: a top-level ``image`` (one) or ``images`` (a list), placed at the
  ``<image>`` markers of the user turns, or before the first user turn's text when there
  is none; an image part without an image (Hugging Face's ``{"type": "image"}`` beside an
  ``images`` column) is such a place too.

``U`` is a ``data:`` URI, a local path (absolute, or relative to the directory of the
file the record came from) or a ``file://`` URL; ``X`` is such a string or a
``datasets.Image`` value ``{"bytes": ..., "path": ...}``. Images are never downloaded: an
``http(s)`` URL is a record problem (:class:`Bad`). An image that cannot be read is an
:class:`UnreadableImage`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

from ..images import (
    ImageError,
    LoadedImage,
    image_part,
    load_image,
    message_images,
    parse_data_uri,
    text_part,
)
from .problems import Bad, UnreadableImage

IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image"})
AUDIO_VIDEO_PART_TYPES = frozenset(
    {"input_audio", "audio", "audio_url", "input_video", "video", "video_url"}
)
AUDIO_VIDEO_KEYS = ("audio", "audios", "video", "videos")
AUDIO_VIDEO = "audio and video prompts are not supported"
MARKER = "<image>"
_IMAGE_KEYS = ("image", "images")
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
# A place for the next top-level image (an image part that carries none); replaced by
# place_top_level_images before the messages leave the record's normalisation.
_PLACE: dict[str, Any] = {"type": "image", "image": None}


class RecordImages:
    """The images of one record: read as its parts name them, kept by hash."""

    __slots__ = ("_source_file", "key", "loaded", "references")

    def __init__(self, record: Mapping[str, Any], source_file: str) -> None:
        self._source_file = source_file
        self.key, self.references = _top_level(record)
        self.loaded: dict[str, LoadedImage] = {}

    def part(self, value: Any, field_path: str) -> dict[str, Any]:
        """The normalised part of an image reference, or a place for a top-level image."""
        if value is None:
            if self.key is None:
                raise Bad(field_path, "an image part without an image (and no images field)")
            return _PLACE
        image = self._load(value, field_path)
        self.loaded.setdefault(image.sha256, image)
        return image_part(image.sha256)

    def in_order(self, messages: Sequence[Mapping[str, Any]]) -> list[LoadedImage]:
        """The distinct images of the messages, in the order they first appear."""
        if not self.loaded:
            return []
        return [self.loaded[sha] for sha in dict.fromkeys(message_images(messages))]

    def _load(self, value: Any, field_path: str) -> LoadedImage:
        if isinstance(value, Mapping):
            return self._load_datasets_image(value, field_path)
        if not isinstance(value, str):
            got = type(value).__name__
            raise Bad(field_path, f"expected an image path, data URI or {{bytes, path}}, got {got}")
        if not value.strip():
            raise Bad(field_path, "empty image reference")
        if value.startswith("data:"):
            try:
                data = parse_data_uri(value)
            except ImageError as exc:
                raise UnreadableImage(field_path, str(exc)) from None
            return _decoded(data, "in data URI", field_path)
        path = self._local_path(value, field_path)
        try:
            data = path.read_bytes()
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise UnreadableImage(field_path, f"cannot read image {value!r} ({reason})") from None
        return _decoded(data, repr(value), field_path)

    def _load_datasets_image(self, value: Mapping[str, Any], field_path: str) -> LoadedImage:
        """A ``datasets.Image`` value: its bytes if present, else its path."""
        data = value.get("bytes")
        if data is not None:
            if not isinstance(data, bytes | bytearray | memoryview):
                got = type(data).__name__
                raise Bad(f"{field_path}.bytes", f"expected binary data, got {got}")
            return _decoded(bytes(data), "bytes", f"{field_path}.bytes")
        if value.get("path") is not None:
            return self._load(value["path"], f"{field_path}.path")
        raise Bad(field_path, "an image object needs bytes or a path")

    def _local_path(self, reference: str, field_path: str) -> Path:
        url = _URL.match(reference)
        if url is not None:
            return _file_url_path(reference, url.group(1).lower(), field_path)
        path = Path(reference)
        return path if path.is_absolute() else Path(self._source_file).parent / path


def _file_url_path(reference: str, scheme: str, field_path: str) -> Path:
    if scheme in ("http", "https"):
        raise Bad(
            field_path,
            f"image URL {reference!r}: images are not downloaded; "
            "download them and give a local path or a data URI",
        )
    if scheme != "file":
        raise Bad(field_path, f"{scheme}:// image URL: give a local path or a data URI")
    parsed = urlparse(reference)
    if parsed.netloc not in ("", "localhost"):
        raise Bad(field_path, f"file URL with a host ({parsed.netloc!r}): give a local path")
    return Path(url2pathname(parsed.path))


def _decoded(data: bytes, where: str, field_path: str) -> LoadedImage:
    try:
        return load_image(data, where)
    except ImageError as exc:
        raise UnreadableImage(field_path, str(exc)) from None


# ----------------------------------------------------------------------------- parts


def image_reference(part: Mapping[str, Any], kind: str, where: str) -> tuple[Any, str]:
    """The image an image part names (None: a place for a top-level image), and its field."""
    if kind == "image":
        for key in ("image", "url", "path"):  # transformers' chat templates take all three
            if part.get(key) is not None:
                return part[key], f"{where}.{key}"
        return None, where
    value = part.get("image_url")
    if value is None:
        raise Bad(f"{where}.image_url", "missing field")
    if isinstance(value, Mapping):  # OpenAI's {"url": ..., "detail": ...}
        if value.get("url") is None:
            raise Bad(f"{where}.image_url.url", "missing field")
        return value["url"], f"{where}.image_url.url"
    return value, f"{where}.image_url"


def canonical_parts(pieces: Sequence[str | dict[str, Any]]) -> list[dict[str, Any]]:
    """Text pieces and image parts as normalised parts: adjacent text joined (as chat
    templates join it), empty text left out, so equal prompts have equal parts."""
    parts: list[dict[str, Any]] = []
    pending = ""
    for piece in pieces:
        if isinstance(piece, str):
            pending += piece
            continue
        if pending:
            parts.append(text_part(pending))
            pending = ""
        parts.append(piece)
    if pending:
        parts.append(text_part(pending))
    return parts


def has_image_place(content: Any) -> bool:
    if isinstance(content, str):
        return MARKER in content
    return any(
        part is _PLACE or (part["type"] == "text" and MARKER in part["text"]) for part in content
    )


# ----------------------------------------------------------------------------- top level


def _top_level(record: Mapping[str, Any]) -> tuple[str | None, list[tuple[Any, str]]]:
    """The record's ``image``/``images`` field and its images with their field paths."""
    present = [key for key in _IMAGE_KEYS if not _empty(record.get(key))]
    if not present:
        return None, []
    if len(present) == 2:
        raise Bad("images", "both image and images given")
    key = present[0]
    value = record[key]
    if not isinstance(value, list):
        if key == "images":
            raise Bad(key, f"expected a list of images, got {type(value).__name__}")
        return key, [(value, key)]
    return key, [(item, f"{key}[{i}]") for i, item in enumerate(value)]


def place_top_level_images(messages: list[dict[str, Any]], images: RecordImages) -> None:
    """Put the record's ``image``/``images`` into its user turns, in place: the n-th
    place (an ``<image>`` marker or an image part without an image) takes the n-th
    image; with no place, they all go before the first user turn's text."""
    key = images.key
    assert key is not None
    for pos, message in enumerate(messages):
        if message["role"] != "user" and has_image_place(message["content"]):
            raise Bad(
                f"turn[{pos}].content",
                f"{MARKER} in a {message['role']} turn: only user turns may carry images",
            )
    places = sum(_places(m["content"]) for m in messages if m["role"] == "user")
    count = len(images.references)
    if places and places != count:
        raise Bad(
            key, f"{places} image place(s) ({MARKER} markers) in the turns but {count} image(s)"
        )
    parts = [images.part(value, field_path) for value, field_path in images.references]
    if not places:
        first_user = next(m for m in messages if m["role"] == "user")
        first_user["content"] = canonical_parts([*parts, *_pieces(first_user["content"])])
        return
    remaining = iter(parts)
    for message in messages:
        if message["role"] == "user" and has_image_place(message["content"]):
            pieces = _pieces(message["content"])
            message["content"] = canonical_parts(
                [next(remaining) if piece is _PLACE else piece for piece in pieces]
            )


def _pieces(content: str | list[dict[str, Any]]) -> list[str | dict[str, Any]]:
    """Content as text pieces, image parts and places, with each marker made a place."""
    items: list[str | dict[str, Any]] = []
    for item in [content] if isinstance(content, str) else content:
        text = item if isinstance(item, str) else item["text"] if item["type"] == "text" else None
        if text is None:
            items.append(item)
            continue
        for i, piece in enumerate(text.split(MARKER)):
            if i:
                items.append(_PLACE)
            items.append(piece)
    return items


def _places(content: str | list[dict[str, Any]]) -> int:
    return sum(piece is _PLACE for piece in _pieces(content))


def _empty(value: Any) -> bool:
    return value is None or (not value and isinstance(value, str | list | dict))
