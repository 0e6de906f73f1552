"""What a prompt file is, told from its first bytes (JSONL, a JSON array, Parquet, Arrow;
gzip- or zstd-compressed), and its bytes decompressed as a stream that names the file when
the compressed data is corrupt. What it is not is said too: a ZIP, HTML, UTF-16 text, a Git
LFS pointer."""

from __future__ import annotations

import codecs
import gzip
import io
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ..errors import PromptFormatError

FORMATS: tuple[str, ...] = ("jsonl", "json", "parquet", "arrow")
EXPECTED = "expected JSONL, JSON, Parquet or Arrow, optionally .gz/.zst compressed"
#: A file that does not start like records is parsed whole only up to this size, to say
#: what it is instead (one JSON object, pretty-printed objects).
PROBE_BYTES = 64 << 20
_HEAD_BYTES = 64 << 10
BOM = b"\xef\xbb\xbf"
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


@dataclass(frozen=True)
class SourceFile:
    """A file of a source, with what its content is (:data:`FORMATS`) and how it is
    compressed (``gzip``, ``zstd`` or None)."""

    path: Path
    format: str
    compression: str | None


def detect_format(path: Path) -> str:
    """``jsonl``, ``json``, ``parquet`` or ``arrow``, by content (after decompression)."""
    return sniff(Path(path)).format


@contextmanager
def open_bytes(path: Path) -> Iterator[IO[bytes]]:
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed below, errors named first
    except FileNotFoundError:
        raise PromptFormatError(f"{path}: prompt source not found") from None
    except PermissionError:
        raise PromptFormatError(f"{path}: cannot read: permission denied") from None
    except IsADirectoryError:
        raise PromptFormatError(f"{path}: is a folder, expected a file") from None
    with fh:
        yield fh


def sniff(path: Path) -> SourceFile:
    with open_bytes(path) as fh:
        head = fh.read(_HEAD_BYTES)
    compression = _compression_of(head)
    if compression is not None:
        head = _decompressed_head(path, compression)
    return SourceFile(path, _format_of(path, head, compression), compression)


def _compression_of(head: bytes) -> str | None:
    if head.startswith(_GZIP_MAGIC):
        return "gzip"
    if head.startswith(_ZSTD_MAGIC):
        return "zstd"
    return None


def _decompressed_head(path: Path, compression: str) -> bytes:
    try:
        with decompressed(path, compression) as stream:
            return stream.read(_HEAD_BYTES)
    except CorruptStream as exc:
        raise PromptFormatError(f"{path}: {exc}") from None


def _format_of(path: Path, head: bytes, compression: str | None) -> str:
    if head.startswith((b"PAR1", b"ARROW1", b"\xff\xff\xff\xff")):
        kind = "parquet" if head.startswith(b"PAR1") else "arrow"
        if compression is None:
            return kind
        raise PromptFormatError(
            f"{path}: {compression}-compressed {kind.title()}: decompress it "
            f"({kind.title()} compresses its own data)"
        )
    text = head.removeprefix(BOM).lstrip(b" \t\r\n")
    if not text:
        if path.name.lower().endswith((".parquet", ".arrow")):
            raise PromptFormatError(f"{path}: empty file")
        return "jsonl"  # empty JSON text: no records
    if text[:1] in (b"[", b"{") and b"\x00" in text[:4]:
        raise PromptFormatError(f"{path}: looks like UTF-16 text: save it as UTF-8")
    if text[:1] == b"[":
        return "json"
    if text[:1] == b"{":
        return "jsonl"
    if head.startswith(b"version https://git-lfs.github.com/spec/"):
        raise PromptFormatError(
            f"{path}: a Git LFS pointer file, not the data: run `git lfs pull` in the "
            "dataset's repository"
        )
    what = _describe(head)
    if compression is not None:
        what = f"{what}, {compression}-compressed"
    if not what.startswith("text"):
        what += f" (first bytes {head[:4].hex(' ')})"
    raise PromptFormatError(f"{path}: looks like {what}: {EXPECTED}")


_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"PK\x03\x04", "a ZIP archive"),
    (b"PK\x05\x06", "an empty ZIP archive"),
    (b"BZh", "bzip2-compressed data"),
    (b"\xfd7zXZ\x00", "xz-compressed data"),
    (b"7z\xbc\xaf\x27\x1c", "a 7-Zip archive"),
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file"),
    (b"SQLite format 3\x00", "an SQLite database"),
    (b"\x93NUMPY", "a NumPy array file"),
    (b"%PDF", "a PDF document"),
    (b"FEA1", "a Feather v1 file"),
    (b"\xff\xfe", "UTF-16 text (save it as UTF-8)"),
    (b"\xfe\xff", "UTF-16 text (save it as UTF-8)"),
)


def _describe(head: bytes) -> str:
    for magic, what in _MAGIC:
        if head.startswith(magic):
            return what
    if head[257:262] == b"ustar":
        return "a tar archive"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "a Python pickle"
    # Incremental: a character cut at byte 200 is held back, not taken for binary.
    sample = codecs.getincrementaldecoder("utf-8")("replace").decode(head[:200])
    if "\ufffd" in sample or any(ord(c) < 32 and c not in "\t\r\n" for c in sample):
        return "binary data"
    start = sample.removeprefix("\ufeff").lstrip()
    if start.startswith("<"):
        return "an HTML or XML document"
    return f"text that is not JSON (it starts {start[:40]!r})"


class CorruptStream(Exception):
    """Compressed data that cannot be decompressed; the reader adds where."""


class _GuardedReader(io.RawIOBase):
    """Turns a decompressor's own errors into :class:`CorruptStream`."""

    def __init__(self, inner: Any, label: str, errors: tuple[type[BaseException], ...]) -> None:
        self._inner = inner
        self._label = label
        self._errors = errors

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        try:
            data = self._inner.read(len(buffer))
        except self._errors as exc:
            raise CorruptStream(
                f"corrupt or truncated {self._label} data ({exc or type(exc).__name__})"
            ) from None
        buffer[: len(data)] = data
        return len(data)


@contextmanager
def decompressed(path: Path, compression: str | None) -> Iterator[IO[bytes]]:
    with open_bytes(path) as raw:
        if compression is None:
            yield raw
        elif compression == "gzip":
            with gzip.GzipFile(fileobj=raw, mode="rb") as inner:
                errors: tuple[type[BaseException], ...] = (OSError, EOFError, zlib.error)
                with io.BufferedReader(_GuardedReader(inner, "gzip", errors), 1 << 20) as out:
                    yield out
        else:
            with io.BufferedReader(_ZstdReader(raw), 1 << 20) as out:
                yield out


class _ZstdReader(io.RawIOBase):
    """zstd frames one after another. zstandard's own stream_reader takes a truncated file
    for a complete one; this says it is truncated."""

    _INPUT_BYTES = 1 << 16  # compressed bytes per step: bounds the output of one step

    def __init__(self, raw: IO[bytes]) -> None:
        import zstandard

        self._raw = raw
        self._error = zstandard.ZstdError
        # Files compressed with --long need a larger window than the default allows.
        self._context = zstandard.ZstdDecompressor(max_window_size=1 << 31)
        self._frame = self._context.decompressobj()
        self._inside_frame = False
        self._out = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._out:
            data = self._raw.read(self._INPUT_BYTES)
            if not data:
                if self._inside_frame:
                    raise CorruptStream("corrupt or truncated zstd data (ends inside a frame)")
                return 0
            self._out = memoryview(self._decompress(data))
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def _decompress(self, data: bytes) -> bytes:
        parts = []
        try:
            while data:
                parts.append(self._frame.decompress(data))
                self._inside_frame = not self._frame.eof
                if self._inside_frame:
                    break
                data = self._frame.unused_data  # the next frame starts here
                self._frame = self._context.decompressobj()
        except self._error as exc:
            raise CorruptStream(f"corrupt or truncated zstd data ({exc})") from None
        return b"".join(parts)
