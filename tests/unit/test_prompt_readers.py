"""Reading prompt sources as the Hub ships them: formats, layouts, bad input, memory."""

from __future__ import annotations

import gzip
import json
import os
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from eagle3data.errors import PromptFormatError
from eagle3data.prompts import file_format, readers
from eagle3data.prompts.file_format import detect_format
from eagle3data.prompts.readers import Location, RecordProblem, SourceRecord, iter_records
from eagle3data.prompts.source_files import source_files

RECORDS: list[dict[str, Any]] = [
    {
        "id": f"r{i}",
        "conversations": [
            {"from": "human", "value": f"question {i}: ünïcödé 🙂 中文"},
            {"from": "gpt", "value": f"answer {i}\nwith a second line"},
        ],
        "score": i * 0.5,
        "n": i,
    }
    for i in range(1, 8)
]


def jsonl_text(records: list[Any]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def values(path: str | Path, **kwargs: Any) -> list[Any]:
    return [r.value for r in iter_records(path, **kwargs)]


def table(records: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(records)


def write_arrow_stream(path: Path, records: list[dict[str, Any]]) -> None:
    t = table(records)
    with pa.ipc.new_stream(str(path), t.schema) as writer:
        writer.write_table(t, max_chunksize=2)


def write_arrow_file(path: Path, records: list[dict[str, Any]]) -> None:
    t = table(records)
    with pa.ipc.new_file(str(path), t.schema) as writer:
        writer.write_table(t, max_chunksize=2)


def write_saved_dataset(folder: Path, records: list[dict[str, Any]], shards: int = 2) -> None:
    """What ``datasets.Dataset.save_to_disk`` writes: Arrow streams listed in state.json."""
    folder.mkdir(parents=True)
    per = -(-len(records) // shards)
    names = []
    for k in range(shards):
        name = f"data-{k:05d}-of-{shards:05d}.arrow"
        write_arrow_stream(folder / name, records[k * per : (k + 1) * per])
        names.append({"filename": name})
    state = {
        "_data_files": names,
        "_fingerprint": "0123456789abcdef",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    (folder / "state.json").write_text(json.dumps(state, indent=2))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {}}))


def write_dataset_dict(folder: Path, splits: dict[str, list[dict[str, Any]]]) -> None:
    for name, records in splits.items():
        write_saved_dataset(folder / name, records, shards=1)
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))


# Each builds a source holding RECORDS in one format or layout and returns its path.
def src_jsonl(d: Path) -> str:
    (d / "a.jsonl").write_text(jsonl_text(RECORDS), encoding="utf-8")
    return str(d / "a.jsonl")


def src_json_pretty(d: Path) -> str:
    (d / "a.json").write_text(json.dumps(RECORDS, indent=2, ensure_ascii=False), "utf-8")
    return str(d / "a.json")


def src_json_one_line(d: Path) -> str:
    (d / "a.json").write_text(json.dumps(RECORDS), encoding="utf-8")
    return str(d / "a.json")


def src_jsonl_gz(d: Path) -> str:
    (d / "a.jsonl.gz").write_bytes(gzip.compress(jsonl_text(RECORDS).encode()))
    return str(d / "a.jsonl.gz")


def src_json_gz(d: Path) -> str:
    (d / "a.json.gz").write_bytes(gzip.compress(json.dumps(RECORDS).encode()))
    return str(d / "a.json.gz")


def src_jsonl_zst(d: Path) -> str:
    data = zstandard.ZstdCompressor().compress(jsonl_text(RECORDS).encode())
    (d / "a.jsonl.zst").write_bytes(data)
    return str(d / "a.jsonl.zst")


def src_json_zst(d: Path) -> str:
    data = zstandard.ZstdCompressor().compress(json.dumps(RECORDS).encode())
    (d / "a.json.zstd").write_bytes(data)
    return str(d / "a.json.zstd")


def src_parquet(d: Path) -> str:
    pq.write_table(table(RECORDS), d / "a.parquet", row_group_size=3)
    return str(d / "a.parquet")


def hub_parquet_repo(d: Path) -> Path:
    """A dataset repository as cloned from the Hub: shards under data/, plus metadata."""
    (d / "data").mkdir(parents=True)
    pq.write_table(table(RECORDS[:4]), d / "data" / "train-00000-of-00002.parquet")
    pq.write_table(table(RECORDS[4:]), d / "data" / "train-00001-of-00002.parquet")
    (d / "README.md").write_text("---\nlicense: mit\n---\n")
    (d / ".gitattributes").write_text("*.parquet filter=lfs\n")
    return d


def src_parquet_folder(d: Path) -> str:
    return str(hub_parquet_repo(d))


def src_parquet_glob(d: Path) -> str:
    return str(hub_parquet_repo(d) / "data" / "*.parquet")


def src_jsonl_gz_folder(d: Path) -> str:
    (d / "data").mkdir()
    (d / "data" / "part-1.jsonl.gz").write_bytes(gzip.compress(jsonl_text(RECORDS[:3]).encode()))
    (d / "data" / "part-2.jsonl").write_text(jsonl_text(RECORDS[3:]), encoding="utf-8")
    return str(d / "data")


def src_arrow_stream(d: Path) -> str:
    write_arrow_stream(d / "a.arrow", RECORDS)
    return str(d / "a.arrow")


def src_arrow_file(d: Path) -> str:
    write_arrow_file(d / "a.arrow", RECORDS)
    return str(d / "a.arrow")


def src_saved_dataset(d: Path) -> str:
    write_saved_dataset(d / "saved", RECORDS)
    return str(d / "saved")


SOURCES: dict[str, Callable[[Path], str]] = {
    "jsonl": src_jsonl,
    "json array, indented": src_json_pretty,
    "json array, one line": src_json_one_line,
    "jsonl.gz": src_jsonl_gz,
    "json.gz": src_json_gz,
    "jsonl.zst": src_jsonl_zst,
    "json.zstd": src_json_zst,
    "parquet": src_parquet,
    "parquet folder (Hub repository)": src_parquet_folder,
    "parquet glob": src_parquet_glob,
    "folder of jsonl and jsonl.gz": src_jsonl_gz_folder,
    "arrow stream": src_arrow_stream,
    "arrow file": src_arrow_file,
    "save_to_disk folder (by hand)": src_saved_dataset,
}


@pytest.mark.parametrize("make", SOURCES.values(), ids=SOURCES.keys())
def test_every_format_gives_the_records_of_the_jsonl(tmp_path: Path, make: Callable) -> None:
    source = make(tmp_path)
    records = list(iter_records(source))
    assert [r.value for r in records] == RECORDS
    assert all(r.duplicate_keys == () for r in records)
    files = source_files(source)
    assert records[0].location.file == str(files[0])
    assert {r.location.file for r in records} == {str(f) for f in files}


def test_real_datasets_save_to_disk(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(RECORDS).save_to_disk(str(tmp_path / "one"), num_shards=2)
    assert values(tmp_path / "one") == RECORDS
    assert [f.name for f in source_files(tmp_path / "one")] == [
        "data-00000-of-00002.arrow",
        "data-00001-of-00002.arrow",
    ]
    splits = {"train": RECORDS[:5], "test": RECORDS[5:]}
    datasets.DatasetDict(
        {name: datasets.Dataset.from_list(rows) for name, rows in splits.items()}
    ).save_to_disk(str(tmp_path / "dict"))
    assert values(tmp_path / "dict", split="test") == RECORDS[5:]
    with pytest.raises(PromptFormatError, match=r"has splits train, test: set datasets"):
        source_files(tmp_path / "dict")


def test_dataset_dict_needs_a_known_split(tmp_path: Path) -> None:
    write_dataset_dict(tmp_path, {"train": RECORDS[:5], "test": RECORDS[5:]})
    assert values(tmp_path, split="train") == RECORDS[:5]
    assert values(tmp_path, split="test") == RECORDS[5:]
    with pytest.raises(PromptFormatError) as no_split:
        iter_records(tmp_path)
    assert str(no_split.value) == (f"{tmp_path}: has splits train, test: set datasets.<name>.split")
    with pytest.raises(PromptFormatError, match=r"no split 'dev' \(it has splits train, test\)"):
        source_files(tmp_path, split="dev")


def test_hub_folder_with_two_splits_needs_split(tmp_path: Path) -> None:
    hub_parquet_repo(tmp_path)
    pq.write_table(table(RECORDS[:2]), tmp_path / "data" / "test-00000-of-00001.parquet")
    with pytest.raises(PromptFormatError, match=r"has splits test, train: set datasets"):
        source_files(tmp_path)
    assert values(tmp_path, split="train") == RECORDS
    assert values(tmp_path, split="test") == RECORDS[:2]
    with pytest.raises(PromptFormatError, match=r"no split 'validation'"):
        source_files(tmp_path, split="validation")


def test_split_on_a_single_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(PromptFormatError, match="is one file"):
        source_files(src_jsonl(tmp_path), split="train")


def test_saved_dataset_of_another_split(tmp_path: Path) -> None:
    write_saved_dataset(tmp_path / "saved", RECORDS)
    state = json.loads((tmp_path / "saved" / "state.json").read_text())
    state["_split"] = "train"
    (tmp_path / "saved" / "state.json").write_text(json.dumps(state))
    assert values(tmp_path / "saved", split="train") == RECORDS
    with pytest.raises(PromptFormatError, match="holds split 'train', not 'test'"):
        source_files(tmp_path / "saved", split="test")


def test_saved_dataset_reads_files_in_state_order(tmp_path: Path) -> None:
    write_saved_dataset(tmp_path / "saved", RECORDS)
    state_path = tmp_path / "saved" / "state.json"
    state = json.loads(state_path.read_text())
    state["_data_files"].reverse()
    state_path.write_text(json.dumps(state))
    assert values(tmp_path / "saved") == RECORDS[4:] + RECORDS[:4]
    (tmp_path / "saved" / "data-00000-of-00002.arrow").unlink()
    with pytest.raises(PromptFormatError, match=r"data-00000-of-00002.arrow: missing"):
        source_files(tmp_path / "saved")


def test_locations(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('\n{"a": 1}\n\n  \n{"a": 2}\n')
    jl = list(iter_records(tmp_path / "a.jsonl"))
    assert [(r.location.record, r.location.line) for r in jl] == [(1, 2), (2, 5)]
    assert str(jl[1].location) == f"{tmp_path / 'a.jsonl'}:5"

    (tmp_path / "a.json").write_text('[\n  {"a": 1},\n\n  {\n    "a": 2\n  }\n]\n')
    arr = list(iter_records(tmp_path / "a.json"))
    assert [(r.location.record, r.location.line) for r in arr] == [(1, 2), (2, 4)]
    assert str(arr[1].location) == f"{tmp_path / 'a.json'} record 2 (line 4)"

    folder = hub_parquet_repo(tmp_path / "hub")
    pq_records = list(iter_records(folder))
    assert [r.location.record for r in pq_records] == [1, 2, 3, 4, 1, 2, 3]
    assert pq_records[4].location == Location(
        str(folder / "data" / "train-00001-of-00002.parquet"), 1, None
    )
    assert str(pq_records[4].location).endswith("train-00001-of-00002.parquet record 1")


def test_source_files_are_sorted_by_relative_path(tmp_path: Path) -> None:
    for name in ("b/2.jsonl", "a/10.jsonl", "a/9.jsonl", ".cache/x.jsonl", "notes.txt"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text('{"a": 1}\n')
    expected = [tmp_path / n for n in ("a/10.jsonl", "a/9.jsonl", "b/2.jsonl")]
    assert source_files(tmp_path) == expected


def test_format_is_told_by_content(tmp_path: Path) -> None:
    (tmp_path / "lines.json").write_text('{"a": 1}\n{"a": 2}\n')
    (tmp_path / "array.jsonl").write_text('  [{"a": 1}]')
    (tmp_path / "array.gz").write_bytes(gzip.compress(b'\n[{"a": 1}]'))
    (tmp_path / "empty.jsonl").write_text("")
    assert detect_format(tmp_path / "lines.json") == "jsonl"
    assert detect_format(tmp_path / "array.jsonl") == "json"
    assert detect_format(tmp_path / "array.gz") == "json"
    assert detect_format(Path(src_parquet(tmp_path))) == "parquet"
    assert detect_format(Path(src_arrow_stream(tmp_path))) == "arrow"
    assert values(tmp_path / "lines.json") == [{"a": 1}, {"a": 2}]
    assert values(tmp_path / "empty.jsonl") == []


@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_utf8_bom_is_tolerated(tmp_path: Path, kind: str) -> None:
    text = jsonl_text(RECORDS) if kind == "jsonl" else json.dumps(RECORDS)
    (tmp_path / "bom").write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert detect_format(tmp_path / "bom") == kind
    assert values(tmp_path / "bom") == RECORDS


def test_bad_jsonl_lines_are_record_problems(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_bytes(
        b'{"a": 1}\n'
        b'{"a": 1 "b": 2}\n'
        b'{"a": "caf\xe9"}\n'
        + b"[" * 100_000
        + b"]" * 100_000
        + b"\n"
        + b'{"n": 1'
        + b"0" * 5000
        + b"}\n"
        b'{"a": 5}\n'
    )
    got = list(iter_records(path))
    assert [r.location.line for r in got] == [1, 2, 3, 4, 5, 6]
    assert got[0].value == {"a": 1} and got[5].value == {"a": 5}
    assert got[1].value == RecordProblem(
        "(line)", "invalid JSON: Expecting ',' delimiter at column 9"
    )
    assert str(got[2].value) == "(line): not UTF-8 text (invalid continuation byte at byte 11)"
    assert got[3].value == RecordProblem("(line)", "nested too deeply")
    assert isinstance(got[4].value, RecordProblem)
    assert str(got[4].value).startswith("(line): invalid JSON: Exceeds the limit")


def test_json_array_syntax_error_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_text('[\n  {"a": 1},\n  {"a": 2,\n   "b" 3},\n  {"a": 4}\n]\n')
    it = iter_records(path)
    assert next(it).value == {"a": 1}
    with pytest.raises(PromptFormatError) as err:
        next(it)
    assert str(err.value) == (
        f"{path}: line 4, column 8: record 2: invalid JSON: Expecting ':' delimiter; "
        "a JSON array cannot be read past a syntax error"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[{"a": 1}, {"a": 2}', "the file ends after record 2, before the closing ']'"),
        ('[{"a": 1}, {"a": 2', "invalid JSON: Expecting ',' delimiter"),
        ('[{"a": 1} {"a": 2}]', "expected ',' or ']' after record 1"),
        ('[{"a": 1},]', "record 2: invalid JSON: Expecting value"),
        ('[{"a": 1}]\n[{"a": 2}]', "line 2, column 1: unexpected text after the array's"),
    ],
)
def test_broken_json_arrays(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "a.json").write_text(text)
    with pytest.raises(PromptFormatError, match=message.replace("(", r"\(").replace("]", r"\]")):
        values(tmp_path / "a.json")


def test_json_array_skips_records_it_cannot_decode(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(readers, "ARRAY_CHUNK_BYTES", 1000)  # the deep record spans chunks
    deep = "[" * 50_000 + '"]]]"' + "]" * 50_000
    path = tmp_path / "a.json"
    path.write_text(f'[{{"a": 1}},\n {deep},\n {{"n": 1{"0" * 5000}}},\n 17, {{"s": "[{{\\"x"}}\n]')
    got = list(iter_records(path))
    assert [r.value for r in got] == [
        {"a": 1},
        RecordProblem("(record)", "nested too deeply"),
        got[2].value,
        17,
        {"s": '[{"x'},
    ]
    assert str(got[2].value).startswith("(record): invalid JSON: Exceeds the limit")
    assert [r.location.line for r in got] == [1, 2, 3, 4, 4]


def test_json_array_ending_inside_a_deep_record(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text('[{"a": 1}, ' + "[" * 50_000)
    with pytest.raises(PromptFormatError, match="the file ends inside record 2"):
        values(tmp_path / "a.json")


@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_lone_surrogates_pass_through(tmp_path: Path, kind: str) -> None:
    text = '{"s": "x\\ud800y", "\\udfff": 1}'
    (tmp_path / "a").write_text(text + "\n" if kind == "jsonl" else f"[{text}]")
    assert values(tmp_path / "a") == [{"s": "x\ud800y", "\udfff": 1}]


@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_duplicate_keys_are_reported(tmp_path: Path, kind: str) -> None:
    dup = '{"id": 1, "m": [{"role": "user", "role": "gpt", "x": 1}], "id": 2}'
    fine = '{"id": 3, "m": [{"role": "user"}, {"role": "user"}]}'
    text = f"{dup}\n{fine}\n" if kind == "jsonl" else f"[{dup}, {fine}]"
    (tmp_path / "a").write_text(text)
    got = list(iter_records(tmp_path / "a"))
    assert got[0].value == {"id": 2, "m": [{"role": "gpt", "x": 1}]}
    assert got[0].duplicate_keys == ("role", "id")
    assert got[1].duplicate_keys == ()


def test_struct_fields_missing_in_a_row_come_back_as_none(tmp_path: Path) -> None:
    rows = [
        {"conversations": [{"from": "human", "value": "hi", "weight": 1.0}]},
        {"conversations": [{"from": "human", "value": "yo"}]},
    ]
    pq.write_table(table(rows), tmp_path / "a.parquet")
    assert values(tmp_path / "a.parquet")[1] == {
        "conversations": [{"from": "human", "value": "yo", "weight": None}]
    }


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"PK\x03\x04\x14\x00\x00\x00", "looks like a ZIP archive (first bytes 50 4b 03 04)"),
        (
            gzip.compress(b"PK\x03\x04 zipped", mtime=0),
            "looks like a ZIP archive, gzip-compressed (first bytes 50 4b 03 04)",
        ),
        (b"\x00\x01\x02\x03garbage", "looks like binary data (first bytes 00 01 02 03)"),
        (b"id,text\n1,hello\n", "looks like text that is not JSON (it starts 'id,text\\\\n1,hello"),
        (b"<!DOCTYPE html><html>", "looks like an HTML or XML document"),
        (gzip.compress(b"PAR1xxxx", mtime=0), "gzip-compressed Parquet: decompress it"),
        (b"\xff\xfe{\x00", "looks like UTF-16 text"),
        (
            b"version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 12\n",
            "a Git LFS pointer file, not the data: run `git lfs pull`",
        ),
    ],
)
def test_unreadable_formats_are_named(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "data.jsonl"
    path.write_bytes(content)
    with pytest.raises(PromptFormatError) as err:
        iter_records(path)
    assert str(err.value).startswith(f"{path}: ")
    assert message.replace("\\\\", "\\") in str(err.value)


def test_zip_message_in_full(tmp_path: Path) -> None:
    (tmp_path / "a.zip").write_bytes(b"PK\x03\x04rest")
    with pytest.raises(PromptFormatError) as err:
        source_files(tmp_path / "a.zip")
    assert str(err.value) == (
        f"{tmp_path / 'a.zip'}: looks like a ZIP archive (first bytes 50 4b 03 04): "
        "expected JSONL, JSON, Parquet or Arrow, optionally .gz/.zst compressed"
    )


def test_one_json_object_is_not_records(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps({"version": 1, "data": RECORDS}, indent=2))
    with pytest.raises(PromptFormatError) as err:
        values(tmp_path / "a.json")
    assert str(err.value) == (
        f"{tmp_path / 'a.json'}: one JSON object, not records: expected a JSON array of "
        "records or JSON Lines (one record per line); the records may be the list under 'data'"
    )
    (tmp_path / "b.json").write_text("\n".join(json.dumps(r, indent=2) for r in RECORDS))
    with pytest.raises(PromptFormatError, match="JSON objects spread over several lines"):
        values(tmp_path / "b.json")


def test_missing_sources(tmp_path: Path) -> None:
    with pytest.raises(PromptFormatError) as err:
        iter_records(tmp_path / "nope.jsonl")
    assert str(err.value) == f"{tmp_path / 'nope.jsonl'}: prompt source not found"
    with pytest.raises(PromptFormatError) as err:
        source_files(tmp_path / "data" / "*.parquet")
    assert str(err.value) == f"{tmp_path / 'data' / '*.parquet'}: no files match this pattern"
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "README.md").write_text("hi")
    with pytest.raises(PromptFormatError) as err:
        source_files(tmp_path / "empty")
    assert str(err.value) == (
        f"{tmp_path / 'empty'}: no JSONL, JSON, Parquet or Arrow files in this folder "
        "(found README.md)"
    )


def test_mixed_formats_in_a_folder(tmp_path: Path) -> None:
    src_parquet(tmp_path)
    src_jsonl(tmp_path)
    with pytest.raises(PromptFormatError, match=r"mixes files of different formats"):
        source_files(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_permission_denied(tmp_path: Path) -> None:
    path = Path(src_jsonl(tmp_path))
    path.chmod(0)
    try:
        with pytest.raises(PromptFormatError) as err:
            iter_records(path)
        assert str(err.value) == f"{path}: cannot read: permission denied"
    finally:
        path.chmod(0o644)


def test_permission_denied_message(tmp_path: Path, monkeypatch: Any) -> None:
    """The same path as above, simulated: tests run as root here, and root reads anything."""
    path = Path(src_jsonl(tmp_path))

    def denied(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(file_format, "open", denied, raising=False)
    with pytest.raises(PromptFormatError) as err:
        iter_records(path)
    assert str(err.value) == f"{path}: cannot read: permission denied"


def test_corrupt_files_name_the_file(tmp_path: Path) -> None:
    pq_path = Path(src_parquet(tmp_path))
    data = pq_path.read_bytes()
    pq_path.write_bytes(data[:4] + b"\x00" * (len(data) - 8) + data[-4:])
    with pytest.raises(PromptFormatError, match=rf"{pq_path}: corrupt Parquet file"):
        values(pq_path)

    arrow_path = Path(src_arrow_stream(tmp_path))
    arrow_path.write_bytes(arrow_path.read_bytes()[:300])
    with pytest.raises(PromptFormatError, match=rf"{arrow_path}: corrupt Arrow file"):
        values(arrow_path)

    gz = tmp_path / "a.jsonl.gz"
    gz.write_bytes(gzip.compress(jsonl_text(RECORDS * 50).encode())[:-60])
    with pytest.raises(PromptFormatError, match=rf"{gz}: corrupt or truncated gzip data"):
        values(gz)

    zst = tmp_path / "a.json.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(json.dumps(RECORDS * 50).encode())[:-60])
    with pytest.raises(PromptFormatError, match=rf"{zst}: .*corrupt or truncated zstd data"):
        values(zst)


@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])
def test_json_array_chunk_boundaries(tmp_path: Path, monkeypatch: Any, chunk: int) -> None:
    """Elements cut anywhere by the buffer: strings, escapes, numbers, multi-byte UTF-8."""
    items: list[Any] = [
        *RECORDS,
        12345678901234567890,
        -1.5e-300,
        'esc \\ " \u00e9 🙂 \n',
        True,
        None,
        [],
        {},
        {"long": "x" * 10_000},
    ]
    (tmp_path / "a.json").write_text(json.dumps(items, indent=1) + "\n")
    whole = list(iter_records(tmp_path / "a.json"))  # the whole file fits one chunk
    monkeypatch.setattr(readers, "ARRAY_CHUNK_BYTES", chunk)
    got = list(iter_records(tmp_path / "a.json"))
    assert [r.value for r in got] == items
    assert [r.location for r in got] == [r.location for r in whole]


def test_json_array_buffer_stays_bounded(tmp_path: Path) -> None:
    records = [{"id": i, "text": "word " * 40} for i in range(20_000)]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(records))
    f = file_format.sniff(path)
    reader = readers._ArrayReader(f, readers._JsonDecoder(), chunk_bytes=4096)
    assert sum(1 for _ in reader) == 20_000
    assert path.stat().st_size > 4_000_000
    assert reader.max_buffer_chars <= 2 * 4096


def test_json_array_streams_in_bounded_memory(tmp_path: Path) -> None:
    path = tmp_path / "big.json"
    record = {"conversations": [{"from": "human", "value": "word " * 100}] * 2}
    with path.open("w") as fh:
        fh.write("[")
        for i in range(20_000):
            fh.write(("," if i else "") + json.dumps({"id": i, **record}))
        fh.write("]")
    size = path.stat().st_size
    assert size > 20_000_000
    tracemalloc.start()
    try:
        count = sum(1 for r in iter_records(path) if isinstance(r.value, dict))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == 20_000
    # About a chunk of bytes, its text, and the buffer being extended: not the file's size
    # (json.load needs several times the file).
    assert peak < 8 * readers.ARRAY_CHUNK_BYTES, (
        f"peak {peak / 1e6:.1f} MB, file {size / 1e6:.0f} MB"
    )


def test_source_record_defaults() -> None:
    record = SourceRecord(Location("f.jsonl", 1, 1), {"a": 1})
    assert record.duplicate_keys == ()
    assert str(RecordProblem("(record)", "nested too deeply")) == "(record): nested too deeply"
