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
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ..errors import PromptFormatError
from .file_format import BOM, PROBE_BYTES, CorruptStream, SourceFile, decompressed
from .source_files import resolve

if TYPE_CHECKING:
    import pyarrow as pa


#: Bytes read from the file (or decompressed) per step of a JSON array.
ARRAY_CHUNK_BYTES = 1 << 20
#: Rows converted to Python at once from Parquet and Arrow batches.
BATCH_ROWS = 1024
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


def iter_records(path: str | Path, *, split: str | None = None) -> Iterator[SourceRecord]:
    """Every record of a source, file after file; raises at once if the source is unusable."""
    files = resolve(path, split)  # eagerly: a missing source fails at the call, not later
    return _records_of(files)


def _records_of(files: list[SourceFile]) -> Iterator[SourceRecord]:
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


def _jsonl_records(f: SourceFile, decoder: _JsonDecoder) -> Iterator[SourceRecord]:
    file = str(f.path)
    record = 0
    lineno = 0
    with decompressed(f.path, f.compression) as stream:
        lines = iter(stream)
        while True:
            try:
                raw = next(lines, None)
            except CorruptStream as exc:
                raise PromptFormatError(f"{file}: {exc} after line {lineno}") from None
            if raw is None:
                return
            lineno += 1
            if lineno == 1:
                raw = raw.removeprefix(BOM)
            if not raw.strip():
                continue
            record += 1
            yield _jsonl_record(f, decoder, raw, Location(file, record, lineno), record == 1)


def _jsonl_record(
    f: SourceFile, decoder: _JsonDecoder, raw: bytes, location: Location, first: bool
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


def _raise_if_not_lines(f: SourceFile) -> None:
    """A file whose first line is not a record may be one pretty-printed JSON document:
    say so once instead of a problem per line."""
    with decompressed(f.path, f.compression) as stream:
        try:
            data = stream.read(PROBE_BYTES + 1)
        except CorruptStream:
            return  # the line-by-line reading reports it where it happens
    if len(data) > PROBE_BYTES:
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

    def __init__(self, f: SourceFile, decoder: _JsonDecoder, chunk_bytes: int = 0) -> None:
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
        with decompressed(self._file.path, self._file.compression) as stream:
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
        except CorruptStream as exc:
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
