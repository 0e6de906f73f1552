"""A PyTorch ``Dataset`` over hidden-state shards, one item per conversation.

::

    from torch.utils.data import DataLoader
    from eagle3data.loader import HiddenStateDataset, pad_collate

    ds = HiddenStateDataset(["results/hidden_states/A1", "results/hidden_states/B2"])
    loader = DataLoader(ds, batch_size=8, shuffle=True, num_workers=4, collate_fn=pad_collate)

Each item is a dict: ``id`` and ``dataset`` (str), ``input_ids`` [L] long, ``loss_mask``
[L] long (0/1), ``aux_hidden_states`` [L, 3H] and ``last_hidden_states`` [L, H] in the
shards' forward dtype, ``hidden_dtype`` (bf16 shards give ``torch.bfloat16``, bit-exact;
shards stored as float8 give the same dtype, dequantized by :mod:`eagle3data.shards`).

``last_hidden_states`` is the final state the shards hold (``dataset.final_state``:
``pre_norm`` or ``post_norm``, see :mod:`eagle3data.hidden_states.final_state`), or the one
asked for::

    HiddenStateDataset(dirs, final_state="post_norm", model="path/to/target")

gives post-norm states from pre-norm shards, through the target's own final norm (exact
for any norm class). Pre-norm states from post-norm shards are refused: that inverse does
not exist.

Shards are opened lazily, in the process that reads them: building the dataset opens
no file when a ``manifest.json`` lists the shards, and a handle opened before a
``DataLoader`` forks its workers is never used by a worker (HDF5 handles do not
survive ``fork``). Only the rows of the requested conversation are read.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from .errors import ShardFormatError
from .hidden_states import fingerprint
from .hidden_states.final_state import (
    FINAL_STATES,
    POST_NORM,
    PRE_NORM,
    FinalNorm,
    final_state_of,
    load_final_norm,
)
from .layout import MANIFEST_NAME, SHARD_GLOB
from .shards import Shard, open_shard

__all__ = ["HiddenStateDataset", "ShardFile", "find_shards", "pad_collate"]

log = logging.getLogger(__name__)

MANIFEST = MANIFEST_NAME


@dataclass(frozen=True)
class ShardFile:
    """One shard of a dataset directory and how many conversations it holds."""

    path: Path
    dataset: str
    num_samples: int
    final_state: str = POST_NORM  # what its last_hidden_states hold
    # What its dataset's capture was (the manifest's; fingerprint.py): the shard must say
    # the same when opened. None: written before fingerprints.
    fingerprint: dict[str, Any] | None = None


def find_shards(directory: str | os.PathLike[str]) -> list[ShardFile]:
    """The shards of one ``results/hidden_states/{dataset}`` directory, in order.

    ``manifest.json`` (written once every shard passed validation) is the source of
    truth when present; otherwise the ``shard-*.h5`` files are listed and opened once
    to count their conversations (and a warning says they are not validated).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such directory of hidden-state shards")
    manifest_path = directory / MANIFEST
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        dataset = str(manifest.get("dataset", directory.name))
        attrs = manifest.get("attrs") or {}
        final_state = final_state_of(attrs, manifest_path)
        captured = manifest.get("capture_fingerprint") or fingerprint.fingerprint_of(attrs)
        return [
            ShardFile(
                directory / entry["file"], dataset, int(entry["samples"]), final_state, captured
            )
            for entry in manifest["shards"]
        ]
    paths = sorted(directory.glob(SHARD_GLOB))
    if not paths:
        raise FileNotFoundError(
            f"{directory}: no {MANIFEST} and no {SHARD_GLOB} files; build them first, "
            f"e.g. `snakemake {directory / MANIFEST}`"
        )
    log.warning("%s: no %s, reading %d unvalidated shard file(s)", directory, MANIFEST, len(paths))
    shards = []
    seen: list[tuple[str, dict[str, Any]]] = []
    for path in paths:
        # Opened and closed here, before any worker exists; workers reopen their own.
        with open_shard(path) as shard:
            attrs = dict(shard.attrs)
            dataset = str(attrs.get("dataset", directory.name))
            final_state = final_state_of(attrs, path)
            captured = fingerprint.fingerprint_of(attrs)
            shards.append(ShardFile(path, dataset, shard.num_samples, final_state, captured))
            seen.append((str(path), attrs))
    mixed = fingerprint.mixed_fingerprint_errors(seen)
    if mixed:
        raise ShardFormatError(mixed[0])
    return shards


class HiddenStateDataset(Dataset[dict[str, Any]]):
    """Conversations of one or more shard directories, read lazily per process."""

    def __init__(
        self,
        directories: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        max_open_shards: int = 8,
        final_state: str | None = None,
        model: str | os.PathLike[str] | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        """``final_state``: ``None`` (what the shards hold; they must agree),
        ``"post_norm"`` (pre-norm shards go through the final norm of ``model``, the
        target's directory) or ``"pre_norm"``."""
        if isinstance(directories, str | os.PathLike):
            directories = [directories]
        if not directories:
            raise ValueError("HiddenStateDataset needs at least one shard directory")
        if max_open_shards < 1:
            raise ValueError(f"max_open_shards must be >= 1, got {max_open_shards}")
        if final_state is not None and final_state not in FINAL_STATES:
            raise ValueError(f"final_state must be one of {list(FINAL_STATES)} or None")
        self.shards: list[ShardFile] = [s for d in directories for s in find_shards(d)]
        self.final_state = self._check_final_state(final_state, model)
        self._model = None if model is None else str(model)
        self._trust_remote_code = trust_remote_code
        self._norms: dict[torch.dtype, FinalNorm] = {}
        # ends[k] = conversations in shards 0..k; item i lives in the first shard with ends > i.
        self._ends: list[int] = []
        total = 0
        for shard in self.shards:
            total += shard.num_samples
            self._ends.append(total)
        self.max_open_shards = max_open_shards
        self._open: OrderedDict[int, Shard] = OrderedDict()
        self._owner_pid = os.getpid()

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def locate(self, index: int) -> tuple[int, int]:
        """(shard number, conversation number within that shard) of item ``index``."""
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for {n} conversations")
        index %= n
        k = bisect.bisect_right(self._ends, index)
        start = self._ends[k - 1] if k else 0
        return k, index - start

    def __getitem__(self, index: int) -> dict[str, Any]:
        k, i = self.locate(index)
        shard = self._shard(k)
        rows = slice(int(shard.sample_offsets[i]), int(shard.sample_offsets[i + 1]))
        return {
            "id": shard.sample_ids[i],
            "dataset": self.shards[k].dataset,
            "input_ids": torch.from_numpy(shard.input_ids[rows]).long(),
            "loss_mask": torch.from_numpy(shard.loss_mask[rows]).long(),
            "aux_hidden_states": shard.aux_hidden_states(rows, as_torch=True),
            "last_hidden_states": self._final(k, shard.last_hidden_states(rows, as_torch=True)),
        }

    def _check_final_state(self, wanted: str | None, model: Any) -> str:
        held = {s.final_state: s.path for s in self.shards}
        if wanted is None:
            if len(held) > 1:
                raise ShardFormatError(
                    f"{held[PRE_NORM]} holds pre-norm and {held[POST_NORM]} post-norm final "
                    f"states: pass final_state= to read them as one"
                )
            return next(iter(held), POST_NORM)
        if wanted == PRE_NORM and POST_NORM in held:
            raise ShardFormatError(
                f"{held[POST_NORM]} holds the post-norm final state; the pre-norm one cannot "
                f"be recovered from it exactly (extract with hidden_states.final_state: "
                f"pre_norm)"
            )
        if wanted == POST_NORM and PRE_NORM in held and model is None:
            raise ValueError(
                f"{held[PRE_NORM]} holds the pre-norm final state: pass model= (the target's "
                f"directory) to get post-norm states through its own final norm"
            )
        return wanted

    def _final(self, k: int, last: torch.Tensor) -> torch.Tensor:
        """The shard's final state as this dataset serves it (see ``final_state``)."""
        if self.shards[k].final_state == self.final_state:
            return last
        norm = self._norms.get(last.dtype)
        if norm is None:
            assert self._model is not None  # _check_final_state
            norm = load_final_norm(
                self._model, dtype=last.dtype, trust_remote_code=self._trust_remote_code
            )
            self._norms[last.dtype] = norm
        return norm(last)

    def close(self) -> None:
        """Close the shards this process opened (reopened on the next read)."""
        if os.getpid() == self._owner_pid:
            for shard in self._open.values():
                shard.close()
        self._open.clear()

    def _shard(self, k: int) -> Shard:
        if os.getpid() != self._owner_pid:
            # A forked worker inherited the parent's handles: never use them.
            self._open = OrderedDict()
            self._owner_pid = os.getpid()
        shard = self._open.get(k)
        if shard is not None:
            self._open.move_to_end(k)
            return shard
        info = self.shards[k]
        shard = open_shard(info.path)
        if shard.num_samples != info.num_samples:
            shard.close()
            raise ShardFormatError(
                f"{info.path}: holds {shard.num_samples} conversations but its "
                f"{MANIFEST} lists {info.num_samples}; the directory changed after validation"
            )
        differ = fingerprint.differences(
            info.fingerprint, fingerprint.fingerprint_of(dict(shard.attrs))
        )
        if differ:
            shard.close()
            raise ShardFormatError(
                f"{info.path}: captured otherwise than its {MANIFEST} says ({'; '.join(differ)});"
                f" the directory changed after validation: validate it again"
            )
        self._open[k] = shard
        if len(self._open) > self.max_open_shards:
            _, oldest = self._open.popitem(last=False)
            oldest.close()
        return shard

    def __getstate__(self) -> dict[str, Any]:
        # Spawned workers get a pickled copy: send the index, never open files.
        state = self.__dict__.copy()
        state["_open"] = OrderedDict()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._owner_pid = os.getpid()


def pad_collate(batch: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Right-pad a list of items to the longest one; adds ``attention_mask`` (1 = real token).

    Padding is 0 everywhere (ids, masks, hidden states), so padded positions never
    carry loss.
    """
    if not batch:
        raise ValueError("pad_collate got an empty batch")
    lengths = [int(item["input_ids"].shape[0]) for item in batch]
    longest = max(lengths)
    out: dict[str, Any] = {
        "id": [item["id"] for item in batch],
        "dataset": [item["dataset"] for item in batch],
        "lengths": torch.tensor(lengths, dtype=torch.long),
    }
    attention = torch.zeros(len(batch), longest, dtype=torch.long)
    for b, n in enumerate(lengths):
        attention[b, :n] = 1
    out["attention_mask"] = attention
    for key in ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_states"):
        first = batch[0][key]
        padded = first.new_zeros((len(batch), longest, *first.shape[1:]))
        for b, item in enumerate(batch):
            padded[b, : lengths[b]] = item[key]
        out[key] = padded
    return out
