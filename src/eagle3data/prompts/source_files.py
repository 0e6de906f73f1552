"""A prompt source resolved to its files, in a stable order: a file, a glob pattern, a folder
of JSONL/JSON/Parquet files as the Hub ships them (``data/train-00000-of-00002.parquet``),
or a ``datasets.save_to_disk`` folder (a ``DatasetDict`` needs ``split``). Every file of
a source must be of one format."""

from __future__ import annotations

import glob
import json
import os
import re
import stat
from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import PromptFormatError
from .file_format import SourceFile, open_bytes, sniff

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


def source_files(path: str | Path, *, split: str | None = None) -> list[Path]:
    """The concrete files of a source, in reading order (also Snakemake's inputs)."""
    return [f.path for f in resolve(path, split)]


def resolve(path: str | Path, split: str | None) -> list[SourceFile]:
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
    files = [sniff(p) for p in chosen]
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
        with open_bytes(path) as fh:
            return json.loads(fh.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PromptFormatError(f"{path}: not valid JSON ({exc})") from None


def _check_one_kind(source: str, files: list[SourceFile]) -> None:
    """JSON text, Parquet and Arrow files never make one dataset together."""
    kinds = {"json" if f.format in ("json", "jsonl") else f.format: f for f in files}
    if len(kinds) > 1:
        examples = ", ".join(f"{f.path} ({f.format})" for f in kinds.values())
        raise PromptFormatError(
            f"{source}: mixes files of different formats ({examples}); "
            "point the source at one kind, e.g. with a glob such as data/*.parquet"
        )
