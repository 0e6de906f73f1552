"""Read the records of a prompt source as the Hugging Face Hub ships it.

A source is a file, a folder or a glob pattern:

* JSON Lines, or a JSON array of records, either optionally gzip- or zstd-compressed;
* Parquet: a file, or a folder of shards as on the Hub (``data/train-00000-of-00002.parquet``);
* Arrow IPC (stream or file format), or a folder written by ``datasets.save_to_disk``
  (``state.json`` + ``data-00000-of-00001.arrow``); a ``DatasetDict`` has one such folder
  per split and needs ``split``;
* a folder of JSONL/JSON files (``data/*.jsonl.gz``).

Records stream one at a time with bounded memory, whatever the file size. A problem with
the whole source (missing, unreadable, an unknown format, a corrupt file) raises
:class:`PromptFormatError` naming the path; a record that cannot be decoded is yielded with
a :class:`RecordProblem` as its value, so that a caller skipping bad records can go on.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import io
import json
import os
import re
import stat
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, TYPE_CHECKING, Any

from ..errors import PromptFormatError

if TYPE_CHECKING:
    import pyarrow as pa

FORMATS: tuple[str, ...] = ("jsonl", "json", "parquet", "arrow")
EXPECTED = "expected JSONL, JSON, Parquet or Arrow, optionally .gz/.zst compressed"

#: Bytes read from the file (or decompressed) per step of a JSON array.
ARRAY_CHUNK_BYTES = 1 << 20
#: Rows converted to Python at once from Parquet and Arrow batches.
BATCH_ROWS = 1024
#: A file that does not start like records is parsed whole only up to this size, to say
#: what it is instead (one JSON object, pretty-printed objects).
_PROBE_BYTES = 64 << 20
_HEAD_BYTES = 64 << 10

_BOM = b"\xef\xbb\xbf"
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_COMPRESSED_SUFFIXES = (".gz", ".zst", ".zstd")
_DATA_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet", ".arrow")
# JSON files datasets and the Hub keep next to the data.
_METADATA_FILES = frozenset(
    {"state.json", "dataset_info.json", "dataset_infos.json", "dataset_dict.json"}
)
_GLOB_CHARS = re.compile(r"[*?[]")
# The Hub's shard names (push_to_hub, the parquet conversion): train-00000-of-00002.parquet.
_SHARD_NAME = re.compile(r"^(?P<split>[A-Za-z_][\w.]*?)-\d+-of-\d+")
_SPLIT_FOLDERS = frozenset(
    {"train", "training", "test", "testing", "validation", "valid", "val", "dev", "eval"}
)
# Characters a JSON array element needs after it in the buffer to be known complete.
_LOOKAHEAD = 64
_JSON_WS = re.compile(r"[ \t\n\r]*")
# A JSON string (complete when group 1 matched), a bracket or a comma: enough to find where
# a value ends without decoding it.
_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(")?|[\[\]{},]', re.DOTALL)


@dataclass(frozen=True)
class Location:
    """Where a record came from: the concrete file, its 1-based record number and line."""

    file: str
    record: int
    line: int | None
    # A JSON array element: its record number says more than a line (arrays are often
    # written on one line), so it is shown first.
    in_array: bool = False

    def __str__(self) -> str:
        if self.line is None:
            return f"{self.file} record {self.record}"
        if self.in_array:
            return f"{self.file} record {self.record} (line {self.line})"
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class RecordProblem:
    """A record that could not be decoded at all."""

    field: str
    problem: str

    def __str__(self) -> str:
        return f"{self.field}: {self.problem}"


@dataclass(frozen=True)
class SourceRecord:
    location: Location
    value: Any
    #: Object keys that appeared more than once somewhere in the record (the last value won).
    duplicate_keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class _File:
    path: Path
    format: str
    compression: str | None


# --- resolving a source to its files ----------------------------------------------------


def source_files(path: str | Path, *, split: str | None = None) -> list[Path]:
    """The concrete files of a source, in reading order (also Snakemake's inputs)."""
    return [f.path for f in _resolve(path, split)]


def iter_records(path: str | Path, *, split: str | None = None) -> Iterator[SourceRecord]:
    """Every record of a source, file after file; raises at once if the source is unusable."""
    files = _resolve(path, split)  # eagerly: a missing source fails at the call, not later
    return _records_of(files)


def _resolve(path: str | Path, split: str | None) -> list[_File]:
    text = os.path.expanduser(str(path))
    src = Path(text)
    if _GLOB_CHARS.search(text) and not os.path.lexists(text):
        found = _glob_files(text)
        chosen = _select_split(text, found, split)
    elif _is_dir(src):
        chosen = _folder_files(src, split)
    else:
        if split is not None:
            raise PromptFormatError(
                f"{src}: split {split!r} is set but the source is one file; "
                "remove split or point the source at the dataset folder"
            )
        chosen = [src]
    files = [_sniff(p) for p in chosen]
    _check_one_kind(text, files)
    return files


def _is_dir(src: Path) -> bool:
    try:
        mode = src.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise PromptFormatError(f"{src}: prompt source not found") from None
    except PermissionError:
        raise PromptFormatError(f"{src}: cannot read: permission denied") from None
    return stat.S_ISDIR(mode)


def _glob_files(pattern: str) -> list[tuple[PurePosixPath, Path]]:
    matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not matches:
        raise PromptFormatError(f"{pattern}: no files match this pattern")
    # Splits are told by the path below the pattern's fixed part: /data/eval/x/*.jsonl
    # holds no split "eval".
    fixed = []
    for part in Path(pattern).parts:
        if _GLOB_CHARS.search(part):
            break
        fixed.append(part)
    base = os.path.join(*fixed) if fixed else os.curdir
    return [(PurePosixPath(Path(os.path.relpath(p, base)).as_posix()), Path(p)) for p in matches]


def _folder_files(folder: Path, split: str | None) -> list[Path]:
    if (folder / "dataset_dict.json").is_file():
        return _dataset_dict_files(folder, split)
    if (folder / "state.json").is_file():
        return _saved_dataset_files(folder, split)
    found, others = _data_files_under(folder)
    if not found:
        seen = f" (found {', '.join(others[:5])}{', ...' if len(others) > 5 else ''})"
        raise PromptFormatError(
            f"{folder}: no JSONL, JSON, Parquet or Arrow files in this folder"
            f"{seen if others else ''}"
        )
    return _select_split(str(folder), found, split)


def _data_files_under(folder: Path) -> tuple[list[tuple[PurePosixPath, Path]], list[str]]:
    """Data files below a folder by relative path, and the names of the other files."""

    def fail(exc: OSError) -> None:
        if isinstance(exc, PermissionError):
            raise PromptFormatError(f"{exc.filename}: cannot read: permission denied") from None
        raise PromptFormatError(f"{exc.filename}: cannot read: {exc.strerror}") from None

    found: list[tuple[PurePosixPath, Path]] = []
    others: list[str] = []
    for root, dirs, names in os.walk(folder, onerror=fail):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # .git, .cache, .huggingface
        for name in sorted(names):
            full = Path(root, name)
            rel = PurePosixPath(full.relative_to(folder).as_posix())
            if _is_data_name(name):
                found.append((rel, full))
            elif not name.startswith("."):
                others.append(str(rel))
    found.sort(key=lambda item: str(item[0]))
    return found, others


def _is_data_name(name: str) -> bool:
    lower = name.lower()
    if lower in _METADATA_FILES:
        return False
    for suffix in _COMPRESSED_SUFFIXES:
        lower = lower.removesuffix(suffix)
    return lower.endswith(_DATA_SUFFIXES)


def _file_split(rel: PurePosixPath) -> str | None:
    """The split a file of a Hub-style layout belongs to, if its path says so."""
    match = _SHARD_NAME.match(rel.name)
    if match:
        return match["split"]
    return next((part for part in rel.parts[:-1] if part in _SPLIT_FOLDERS), None)


def _select_split(
    source: str, files: list[tuple[PurePosixPath, Path]], split: str | None
) -> list[Path]:
    """Keep the files of one split: reading train and test together would mix them."""
    splits = [_file_split(rel) for rel, _ in files]
    named = sorted({s for s in splits if s is not None})
    if split is None:
        if len(named) > 1:
            raise PromptFormatError(
                f"{source}: has splits {', '.join(named)}: set datasets.<name>.split"
            )
        return [p for _, p in files]
    chosen = [p for (_, p), s in zip(files, splits, strict=True) if s == split]
    if not chosen:
        has = (
            f"it has splits {', '.join(named)}"
            if named
            else "its file names name no split, as train-00000-of-00001.parquet or train/ do"
        )
        raise PromptFormatError(f"{source}: no split {split!r} ({has})")
    return chosen


def _dataset_dict_files(folder: Path, split: str | None) -> list[Path]:
    """A ``DatasetDict.save_to_disk`` folder: ``dataset_dict.json`` and a folder per split."""
    info = _read_json_file(folder / "dataset_dict.json")
    splits = info.get("splits") if isinstance(info, dict) else None
    if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
        raise PromptFormatError(
            f'{folder / "dataset_dict.json"}: expected {{"splits": [...]}} '
            "as datasets' DatasetDict.save_to_disk writes it"
        )
    names = ", ".join(splits)
    if split is None:
        raise PromptFormatError(f"{folder}: has splits {names}: set datasets.<name>.split")
    if split not in splits:
        raise PromptFormatError(f"{folder}: no split {split!r} (it has splits {names})")
    sub = folder / split
    if not (sub / "state.json").is_file():
        raise PromptFormatError(
            f"{sub}: missing or not a saved dataset (dataset_dict.json lists split {split!r})"
        )
    return _saved_dataset_files(sub, None)


def _saved_dataset_files(folder: Path, split: str | None) -> list[Path]:
    """A ``Dataset.save_to_disk`` folder: ``state.json`` lists its Arrow files in order."""
    state_path = folder / "state.json"
    state = _read_json_file(state_path)
    entries = state.get("_data_files") if isinstance(state, dict) else None
    if (
        not isinstance(entries, list)
        or not entries
        or not all(isinstance(e, dict) and isinstance(e.get("filename"), str) for e in entries)
    ):
        raise PromptFormatError(
            f'{state_path}: expected "_data_files": [{{"filename": ...}}, ...] '
            "as datasets' save_to_disk writes it"
        )
    saved_split = state.get("_split")
    if split is not None and saved_split is not None and saved_split != split:
        raise PromptFormatError(f"{folder}: holds split {saved_split!r}, not {split!r}")
    files = [folder / e["filename"] for e in entries]
    for f in files:
        if not f.is_file():
            raise PromptFormatError(f"{f}: missing (listed in {state_path})")
    return files


def _read_json_file(path: Path) -> Any:
    try:
        with _open(path) as fh:
            return json.loads(fh.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PromptFormatError(f"{path}: not valid JSON ({exc})") from None


def _check_one_kind(source: str, files: list[_File]) -> None:
    """JSON text, Parquet and Arrow files never make one dataset together."""
    kinds = {"json" if f.format in ("json", "jsonl") else f.format: f for f in files}
    if len(kinds) > 1:
        examples = ", ".join(f"{f.path} ({f.format})" for f in kinds.values())
        raise PromptFormatError(
            f"{source}: mixes files of different formats ({examples}); "
            "point the source at one kind, e.g. with a glob such as data/*.parquet"
        )


# --- telling the format -----------------------------------------------------------------


def detect_format(path: Path) -> str:
    """``jsonl``, ``json``, ``parquet`` or ``arrow``, by content (after decompression)."""
    return _sniff(Path(path)).format


@contextmanager
def _open(path: Path) -> Iterator[IO[bytes]]:
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


def _sniff(path: Path) -> _File:
    with _open(path) as fh:
        head = fh.read(_HEAD_BYTES)
    compression = _compression_of(head)
    if compression is not None:
        head = _decompressed_head(path, compression)
    return _File(path, _format_of(path, head, compression), compression)


def _compression_of(head: bytes) -> str | None:
    if head.startswith(_GZIP_MAGIC):
        return "gzip"
    if head.startswith(_ZSTD_MAGIC):
        return "zstd"
    return None


def _decompressed_head(path: Path, compression: str) -> bytes:
    try:
        with _decompressed(path, compression) as stream:
            return stream.read(_HEAD_BYTES)
    except _CorruptStream as exc:
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
    text = head.removeprefix(_BOM).lstrip(b" \t\r\n")
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


# --- opening (decompressing) a file -------------------------------------------------------


class _CorruptStream(Exception):
    """Compressed data that cannot be decompressed; the reader adds where."""


class _GuardedReader(io.RawIOBase):
    """Turns a decompressor's own errors into :class:`_CorruptStream`."""

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
            raise _CorruptStream(
                f"corrupt or truncated {self._label} data ({exc or type(exc).__name__})"
            ) from None
        buffer[: len(data)] = data
        return len(data)


@contextmanager
def _decompressed(path: Path, compression: str | None) -> Iterator[IO[bytes]]:
    with _open(path) as raw:
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
                    raise _CorruptStream("corrupt or truncated zstd data (ends inside a frame)")
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
            raise _CorruptStream(f"corrupt or truncated zstd data ({exc})") from None
        return b"".join(parts)


# --- records ------------------------------------------------------------------------------


def _records_of(files: list[_File]) -> Iterator[SourceRecord]:
    decoder = _JsonDecoder()
    for f in files:
        if f.format == "jsonl":
            yield from _jsonl_records(f, decoder)
        elif f.format == "json":
            yield from _ArrayReader(f, decoder)
        elif f.format == "parquet":
            yield from _table_records(f.path, _parquet_batches(f.path))
        else:
            yield from _table_records(f.path, _arrow_batches(f.path))


class _JsonDecoder:
    """json's C decoder, noting object keys that occur twice (json keeps the last value)."""

    def __init__(self) -> None:
        duplicates: list[str] = []

        # A closure with its builtins bound: called for every object, it costs ~1.5x the
        # decoding time of json.loads alone (measured), a bound method more.
        def pairs_to_dict(
            pairs: list[tuple[str, Any]], dict: type[dict[str, Any]] = dict, len: Any = len
        ) -> dict[str, Any]:
            obj = dict(pairs)
            if len(obj) != len(pairs):
                _note_duplicates(pairs, duplicates)
            return obj

        self._duplicates = duplicates
        self._decoder = json.JSONDecoder(object_pairs_hook=pairs_to_dict)

    def decode(self, text: str) -> tuple[Any, tuple[str, ...]]:
        """One JSON document; raises JSONDecodeError, RecursionError or ValueError."""
        self._duplicates.clear()
        value = self._decoder.decode(text)
        return value, tuple(self._duplicates)

    def raw_decode(self, text: str, pos: int) -> tuple[Any, int, tuple[str, ...]]:
        """The JSON value at ``pos`` (no leading whitespace) and where it ends."""
        self._duplicates.clear()
        value, end = self._decoder.raw_decode(text, pos)
        return value, end, tuple(self._duplicates)


def _note_duplicates(pairs: list[tuple[str, Any]], duplicates: list[str]) -> None:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen and key not in duplicates:
            duplicates.append(key)
        seen.add(key)


def _undecodable(field: str, exc: Exception) -> RecordProblem:
    if isinstance(exc, RecursionError):
        return RecordProblem(field, "nested too deeply")
    if isinstance(exc, json.JSONDecodeError):
        return RecordProblem(field, f"invalid JSON: {exc.msg} at column {exc.colno}")
    # e.g. an integer longer than Python converts (sys.get_int_max_str_digits)
    return RecordProblem(field, f"invalid JSON: {exc}")


def _jsonl_records(f: _File, decoder: _JsonDecoder) -> Iterator[SourceRecord]:
    file = str(f.path)
    record = 0
    lineno = 0
    with _decompressed(f.path, f.compression) as stream:
        lines = iter(stream)
        while True:
            try:
                raw = next(lines, None)
            except _CorruptStream as exc:
                raise PromptFormatError(f"{file}: {exc} after line {lineno}") from None
            if raw is None:
                return
            lineno += 1
            if lineno == 1:
                raw = raw.removeprefix(_BOM)
            if not raw.strip():
                continue
            record += 1
            yield _jsonl_record(f, decoder, raw, Location(file, record, lineno), record == 1)


def _jsonl_record(
    f: _File, decoder: _JsonDecoder, raw: bytes, location: Location, first: bool
) -> SourceRecord:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        problem = f"not UTF-8 text ({exc.reason} at byte {exc.start + 1})"
        return SourceRecord(location, RecordProblem("(line)", problem))
    try:
        value, duplicates = decoder.decode(text)
    except (ValueError, RecursionError) as exc:
        if first and isinstance(exc, json.JSONDecodeError):
            _raise_if_not_lines(f)
        return SourceRecord(location, _undecodable("(line)", exc))
    return SourceRecord(location, value, duplicates)


def _raise_if_not_lines(f: _File) -> None:
    """A file whose first line is not a record may be one pretty-printed JSON document:
    say so once instead of a problem per line."""
    with _decompressed(f.path, f.compression) as stream:
        try:
            data = stream.read(_PROBE_BYTES + 1)
        except _CorruptStream:
            return  # the line-by-line reading reports it where it happens
    if len(data) > _PROBE_BYTES:
        return
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
        value, end = json.JSONDecoder().raw_decode(text, _JSON_WS.match(text).end())  # type: ignore[union-attr]
    except (ValueError, RecursionError):
        return
    if not isinstance(value, dict):
        return
    many = bool(text[end:].strip())
    what = "JSON objects spread over several lines" if many else "one JSON object"
    hint = "" if many else _records_key_hint(value)
    raise PromptFormatError(
        f"{f.path}: {what}, not records: expected a JSON array of records or JSON Lines "
        f"(one record per line){hint}"
    )


def _records_key_hint(obj: dict[str, Any]) -> str:
    for key, value in obj.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            return f"; the records may be the list under {key!r}"
    return ""


class _ArrayReader:
    """Streams the elements of a top-level JSON array with bounded memory.

    ``json.load`` holds the whole text and every record at once: several times the file
    (2.5x measured on an indented ShareGPT array), gigabytes for OpenHermes' 1.9 GB array.
    ijson streams, but gives neither the line where a record starts nor a way past a
    record it cannot decode (and would be one more dependency). So this keeps a text
    buffer of about one chunk plus the record being read, and decodes each element with
    json's C ``raw_decode``, reading more when an element runs past the buffer's end.
    """

    def __init__(self, f: _File, decoder: _JsonDecoder, chunk_bytes: int = 0) -> None:
        self._file = f
        self._decoder = decoder
        self._chunk = chunk_bytes or ARRAY_CHUNK_BYTES
        self._buf = ""
        self._pos = 0  # next unread character of the buffer
        self._dropped = 0  # characters dropped from the buffer's front so far
        self._line = 1  # line of the character at _pos
        self._line_start = 0  # absolute character offset where that line starts
        self._bytes_read = 0
        self._eof = False
        self._stream: IO[bytes] | None = None
        self._utf8 = codecs.getincrementaldecoder("utf-8")("strict")
        self.max_buffer_chars = 0  # observed by the tests of bounded memory

    def __iter__(self) -> Iterator[SourceRecord]:
        with _decompressed(self._file.path, self._file.compression) as stream:
            self._stream = stream
            yield from self._elements()

    def _elements(self) -> Iterator[SourceRecord]:
        file = str(self._file.path)
        self._fill()
        if self._buf.startswith("\ufeff"):
            self._pos = 1
        self._skip_ws()
        if self._peek() != "[":
            raise self._error("expected a JSON array of records")
        self._pos += 1
        self._skip_ws()
        if self._peek() == "]":
            self._pos += 1
        else:
            record = 0
            while True:
                record += 1
                location = Location(file, record, self._line, in_array=True)
                value, duplicates = self._element(record)
                yield SourceRecord(location, value, duplicates)
                self._skip_ws()
                char = self._peek()
                self._pos += 1
                if char == "]":
                    break
                if char != ",":
                    raise self._error(
                        f"expected ',' or ']' after record {record}"
                        if char
                        else f"the file ends after record {record}, before the closing ']'",
                        self._pos - 1,
                    )
                self._skip_ws()
        self._skip_ws()
        if self._peek():
            raise self._error("unexpected text after the array's closing ']'")

    def _element(self, record: int) -> tuple[Any, tuple[str, ...]]:
        while True:
            try:
                value, end, duplicates = self._decoder.raw_decode(self._buf, self._pos)
            except json.JSONDecodeError as exc:
                if not self._eof and self._may_be_cut(exc):
                    self._fill(more=True)
                    continue
                raise self._error(
                    f"record {record}: invalid JSON: {exc.msg}; "
                    "a JSON array cannot be read past a syntax error",
                    exc.pos,
                ) from None
            except (ValueError, RecursionError) as exc:
                end = self._value_end(record)
                self._advance(end)
                return _undecodable("(record)", exc), ()
            if len(self._buf) - end < _LOOKAHEAD and not self._eof:
                # A number may go on in the next chunk: "1.5e" decodes as 1.5, ending at "e".
                self._fill()
                continue
            self._advance(end)
            return value, duplicates

    def _may_be_cut(self, exc: json.JSONDecodeError) -> bool:
        """Whether the error may only mean that the element goes on past the buffer."""
        # A string runs to the next quote, so an unterminated one is cut by the buffer's
        # end; any other error of a cut element lies within a few characters of it (an
        # escape \\uXXXX, a number's exponent).
        return exc.msg.startswith("Unterminated string") or exc.pos >= len(self._buf) - 16

    def _value_end(self, record: int) -> int:
        """Where the element at the read position ends, without decoding it.

        Used for elements json cannot decode but whose end can be found (too deep, an
        integer too long): by strings, brackets and commas, reading more as needed.
        """
        depth = 0
        offset = 0  # relative to _pos: _fill moves the buffer
        while True:
            for match in _JSON_TOKEN.finditer(self._buf, self._pos + offset):
                token = match.group()
                if token[0] == '"':
                    if match.group(1) is None:
                        break  # the string goes on past the buffer
                elif token in "[{":
                    depth += 1
                elif depth == 0:  # the ',' or ']' after an element that is no object or list
                    return match.start()
                elif token != ",":
                    depth -= 1
                    if depth == 0:
                        return match.end()
                offset = match.end() - self._pos
            else:
                offset = len(self._buf) - self._pos
            if self._eof:
                raise self._error(f"the file ends inside record {record}")
            self._fill(more=True)

    def _fill(self, more: bool = False) -> None:
        """Read the next chunk; with ``more`` at least as much as is pending (amortised)."""
        assert self._stream is not None
        pending = len(self._buf) - self._pos
        size = max(self._chunk, pending) if more else self._chunk
        try:
            data = self._stream.read(size)
        except _CorruptStream as exc:
            raise self._error(str(exc)) from None
        self._eof = not data
        try:
            text = self._utf8.decode(data, final=self._eof)
        except UnicodeDecodeError as exc:
            raise self._error(
                f"not UTF-8 text ({exc.reason} near byte {self._bytes_read + exc.start + 1})",
                len(self._buf),
            ) from None
        self._bytes_read += len(data)
        self._dropped += self._pos
        self._buf = self._buf[self._pos :] + text
        self._pos = 0
        self.max_buffer_chars = max(self.max_buffer_chars, len(self._buf))

    def _peek(self) -> str:
        """The character at the read position ("" at the end of the file)."""
        while self._pos >= len(self._buf) and not self._eof:
            self._fill()
        return self._buf[self._pos : self._pos + 1]

    def _skip_ws(self) -> None:
        while True:
            self._advance(_JSON_WS.match(self._buf, self._pos).end())  # type: ignore[union-attr]
            if self._pos < len(self._buf) or self._eof:
                return
            self._fill()

    def _advance(self, end: int) -> None:
        newlines = self._buf.count("\n", self._pos, end)
        if newlines:
            self._line += newlines
            self._line_start = self._dropped + self._buf.rfind("\n", self._pos, end) + 1
        self._pos = end

    def _error(self, message: str, at: int | None = None) -> PromptFormatError:
        """A file error at buffer index ``at`` (default: the read position)."""
        at = self._pos if at is None else min(at, len(self._buf))
        line, line_start = self._line, self._line_start
        newlines = self._buf.count("\n", self._pos, at)
        if newlines:
            line += newlines
            line_start = self._dropped + self._buf.rfind("\n", self._pos, at) + 1
        column = self._dropped + at - line_start + 1
        return PromptFormatError(f"{self._file.path}: line {line}, column {column}: {message}")


def _table_records(path: Path, batches: Iterable[pa.RecordBatch]) -> Iterator[SourceRecord]:
    file = str(path)
    record = 0
    for batch in batches:
        # Rows become Python objects a slice at a time: a batch may hold a whole row group.
        for start in range(0, batch.num_rows, BATCH_ROWS):
            for row in batch.slice(start, BATCH_ROWS).to_pylist():
                record += 1
                yield SourceRecord(Location(file, record, None), row)


def _parquet_batches(path: Path) -> Iterator[pa.RecordBatch]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    done = 0
    try:
        with pq.ParquetFile(path) as pf:
            for batch in pf.iter_batches(batch_size=BATCH_ROWS):
                yield batch
                done += batch.num_rows
    except (pa.ArrowException, OSError) as exc:
        raise _table_error(path, "Parquet", exc, done) from None


def _arrow_batches(path: Path) -> Iterator[pa.RecordBatch]:
    """Batches of an Arrow IPC file or stream (datasets writes streams), one at a time."""
    import pyarrow as pa

    done = 0
    try:
        with pa.OSFile(str(path)) as fh:
            if fh.read(6) == b"ARROW1":
                fh.seek(0)
                reader = pa.ipc.open_file(fh)
                batches: Iterable[pa.RecordBatch] = (
                    reader.get_batch(i) for i in range(reader.num_record_batches)
                )
            else:
                fh.seek(0)
                batches = pa.ipc.open_stream(fh)
            for batch in batches:
                yield batch
                done += batch.num_rows
    except (pa.ArrowException, OSError) as exc:
        raise _table_error(path, "Arrow", exc, done) from None


def _table_error(path: Path, kind: str, exc: BaseException, done: int) -> PromptFormatError:
    if isinstance(exc, PermissionError):
        return PromptFormatError(f"{path}: cannot read: permission denied")
    after = f" after record {done}" if done else ""
    return PromptFormatError(f"{path}: corrupt {kind} file{after} ({exc})")
