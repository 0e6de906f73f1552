"""Images in prompts: the normalised image part, decoding, and the image table.

A message whose content holds an image has ``content`` as a list of parts, in order::

    [{"type": "text", "text": str}, {"type": "image", "image": "<sha256 of the bytes>"}, ...]

(a text-only message keeps ``content`` as a plain str). The part names the image by the
sha256 of its file's bytes, so anything hashing the messages (prompt hashes, ids,
duplicate checks) covers the image content. The bytes live once per dataset in the image
table ``results/prompts/{dataset}.images.parquet``: one row per distinct image in
first-seen order, columns ``sha256``, ``mime``, ``width``, ``height``, ``bytes``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from bisect import bisect_right
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import unquote_to_bytes

import pyarrow as pa
import pyarrow.parquet as pq

from .atomic import atomic_path

if TYPE_CHECKING:
    from PIL.Image import Image

IMAGE = "image"
TEXT = "text"

IMAGE_SCHEMA = pa.schema(
    [
        ("sha256", pa.string()),
        ("mime", pa.string()),
        ("width", pa.uint32()),
        ("height", pa.uint32()),
        ("bytes", pa.binary()),
    ]
)
# Rows per row group: a lookup reads one group, so groups stay small (a few MB of images).
_GROUP_ROWS = 64
_GROUP_BYTES = 16 << 20


class ImageError(ValueError):
    """Image data that cannot be used; the message says which and why."""


@dataclass(frozen=True)
class ImageInfo:
    sha256: str
    mime: str
    width: int
    height: int


@dataclass(frozen=True)
class LoadedImage(ImageInfo):
    """An image read and decoded at ingest: what the image table stores."""

    data: bytes = field(repr=False)


# ----------------------------------------------------------------------------- parts


def image_part(sha256: str) -> dict[str, str]:
    return {"type": IMAGE, "image": sha256}


def text_part(text: str) -> dict[str, str]:
    return {"type": TEXT, "text": text}


def is_image_part(part: Mapping[str, Any]) -> bool:
    return part.get("type") == IMAGE


def message_images(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """The sha256 of every image part, in message and part order (repeats kept)."""
    return [
        part["image"]
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if is_image_part(part)
    ]


def content_text(content: str | Sequence[Mapping[str, Any]]) -> str:
    """A message's text: a str as is; of parts, the text parts joined (images left out)."""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part.get("type") == TEXT)


def has_images(messages: Sequence[Mapping[str, Any]]) -> bool:
    return any(
        isinstance(message.get("content"), list) and any(map(is_image_part, message["content"]))
        for message in messages
    )


# ----------------------------------------------------------------------------- bytes


def image_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def decode_image(data: bytes, where: str) -> tuple[str, int, int]:
    """(mime, width, height) of an image, decoded in full; ``where`` names it in errors."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()  # open() reads only the header: a truncated file fails here
            kind = image.format or "unknown"
            mime = Image.MIME.get(kind) or f"image/{kind.lower()}"
            return mime, image.width, image.height
    except Exception as exc:  # Pillow's decoders raise many kinds for bad data
        # Pillow's own message for an unknown format names a Python object: not useful.
        unknown = isinstance(exc, UnidentifiedImageError)
        reason = "not an image format Pillow reads" if unknown else str(exc) or type(exc).__name__
        raise ImageError(f"cannot read image {where} ({reason})") from None


def load_image(data: bytes, where: str) -> LoadedImage:
    """Hash and decode image bytes; raises :class:`ImageError` naming ``where``."""
    mime, width, height = decode_image(data, where)
    return LoadedImage(image_sha256(data), mime, width, height, data)


def pil_image(data: bytes) -> Image:
    """Image bytes as the RGB picture a processor takes (servers convert theirs so too)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB")


class ImageSource(Protocol):
    """Where an engine reads an image part's bytes (an :class:`ImageTable`)."""

    def get(self, sha256: str) -> bytes: ...

    def info(self, sha256: str) -> ImageInfo: ...


def data_uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def parse_data_uri(uri: str) -> bytes:
    """The bytes of a ``data:`` URI (base64 or percent-encoded); :class:`ImageError` if
    it is malformed."""
    if not uri.startswith("data:"):
        raise ImageError("malformed data URI (it does not start with 'data:')")
    header, comma, payload = uri[5:].partition(",")
    if not comma:
        raise ImageError("malformed data URI (no ',' before the data)")
    if not header.endswith(";base64"):
        return unquote_to_bytes(payload)
    try:
        # Base64 wrapped over lines is common; anything else outside the alphabet is not.
        return base64.b64decode("".join(payload.split()), validate=True)
    except binascii.Error as exc:
        raise ImageError(f"malformed data URI (bad base64: {exc})") from None


# ----------------------------------------------------------------------------- table


class ImageTableWriter:
    """Stream distinct images into the image table, written atomically on a clean exit.

    Only the hashes seen are held, and the rows of one small row group at a time.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._seen: set[str] = set()
        self._pending: list[LoadedImage] = []
        self._pending_bytes = 0
        self._stack = ExitStack()
        self._writer: pq.ParquetWriter | None = None

    def __enter__(self) -> ImageTableWriter:
        tmp = self._stack.enter_context(atomic_path(self.path))
        self._writer = pq.ParquetWriter(tmp, IMAGE_SCHEMA)
        self._stack.callback(self._writer.close)  # closed before atomic_path renames
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        if exc_type is not None:  # nothing is renamed into place
            return self._stack.__exit__(exc_type, exc, tb)
        with self._stack:  # a failing last write leaves no table either
            self._flush()
        return None

    def __len__(self) -> int:
        return len(self._seen)

    def add(self, image: LoadedImage) -> bool:
        """Add an image unless one with its hash was added before; whether it was new."""
        if image.sha256 in self._seen:
            return False
        self._seen.add(image.sha256)
        self._pending.append(image)
        self._pending_bytes += len(image.data)
        if len(self._pending) >= _GROUP_ROWS or self._pending_bytes >= _GROUP_BYTES:
            self._flush()
        return True

    def _flush(self) -> None:
        if not self._pending:
            return
        assert self._writer is not None, "ImageTableWriter is used as a context manager"
        rows = self._pending
        table = pa.table(
            {
                "sha256": [i.sha256 for i in rows],
                "mime": [i.mime for i in rows],
                "width": [i.width for i in rows],
                "height": [i.height for i in rows],
                "bytes": [i.data for i in rows],
            },
            schema=IMAGE_SCHEMA,
        )
        self._writer.write_table(table)
        self._pending, self._pending_bytes = [], 0


class ImageTable:
    """Read an image table by hash: the hashes are read once, a row's group on demand."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = pq.ParquetFile(self.path)
        hashes = self._file.read(columns=["sha256"]).column(0).to_pylist()
        self._rows: dict[str, int] = {sha: row for row, sha in enumerate(hashes)}
        metadata = self._file.metadata
        self._group_starts: list[int] = []
        start = 0
        for group in range(metadata.num_row_groups):
            self._group_starts.append(start)
            start += metadata.row_group(group).num_rows
        self._cached: tuple[int, pa.Table] | None = None  # the group read last

    def __enter__(self) -> ImageTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, sha256: object) -> bool:
        return sha256 in self._rows

    def __iter__(self) -> Iterator[str]:
        """The hashes, in first-seen order."""
        return iter(self._rows)

    def get(self, sha256: str) -> bytes:
        data: bytes = self._row(sha256)["bytes"]
        return data

    def info(self, sha256: str) -> ImageInfo:
        row = self._row(sha256)
        return ImageInfo(sha256, row["mime"], row["width"], row["height"])

    def _row(self, sha256: str) -> dict[str, Any]:
        row = self._rows.get(sha256)
        if row is None:
            raise KeyError(f"{self.path}: no image with sha256 {sha256}")
        group = bisect_right(self._group_starts, row) - 1
        if self._cached is None or self._cached[0] != group:
            self._cached = (group, self._file.read_row_group(group))
        found: dict[str, Any] = (
            self._cached[1].slice(row - self._group_starts[group], 1).to_pylist()[0]
        )
        return found
