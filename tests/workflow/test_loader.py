"""The PyTorch loader over shards made by the real workflow (tiny random bf16 Llama)."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from support.workflow import Workflow
from torch.utils.data import DataLoader

from eagle3data.loader import HiddenStateDataset, find_shards, pad_collate
from eagle3data.shards import ShardFormatError, open_shard

pytestmark = pytest.mark.e2e


@pytest.fixture
def finished(finished_run: Workflow) -> Workflow:
    """The session's finished run (tests/conftest.py): A1 and B2 in several shards each."""
    return finished_run


def shard_dir(wf: Workflow, dataset: str) -> Path:
    return wf.path(f"results/hidden_states/{dataset}")


def direct_reads(directory: Path) -> list[dict]:
    """Every conversation as open_shard reads it, in manifest order."""
    manifest = json.loads((directory / "manifest.json").read_text())
    out = []
    for entry in manifest["shards"]:
        with open_shard(directory / entry["file"]) as shard:
            for i in range(shard.num_samples):
                rows = slice(int(shard.sample_offsets[i]), int(shard.sample_offsets[i + 1]))
                out.append(
                    {
                        "id": shard.sample_ids[i],
                        "input_ids": shard.input_ids[rows],
                        "loss_mask": shard.loss_mask[rows],
                        "aux": shard.aux_hidden_states(rows, as_torch=True),
                        "last": shard.last_hidden_states(rows, as_torch=True),
                    }
                )
    return out


def assert_same(item: dict, want: dict, dataset: str) -> None:
    assert item["id"] == want["id"]
    assert item["dataset"] == dataset
    assert item["input_ids"].dtype == torch.long
    assert item["loss_mask"].dtype == torch.long
    assert np.array_equal(item["input_ids"].numpy(), want["input_ids"])
    assert np.array_equal(item["loss_mask"].numpy(), want["loss_mask"])
    for key, ref in (("aux_hidden_states", want["aux"]), ("last_hidden_states", want["last"])):
        assert item[key].dtype == torch.bfloat16  # the stored dtype, not a float32 copy
        # Bit-exact: compare the raw 16-bit patterns.
        assert torch.equal(item[key].view(torch.int16), ref.view(torch.int16))


def test_items_equal_open_shard_reads(finished: Workflow) -> None:
    directory = shard_dir(finished, "A1")
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["num_shards"] >= 2, "several shards exercise the index"
    data = HiddenStateDataset(directory)
    want = direct_reads(directory)
    assert len(data) == len(want) == manifest["num_samples"]
    h = manifest["attrs"]["hidden_size"]
    for i, ref in enumerate(want):
        item = data[i]
        assert_same(item, ref, "A1")
        n = len(ref["input_ids"])
        assert item["aux_hidden_states"].shape == (n, 3 * h)
        assert item["last_hidden_states"].shape == (n, h)
    assert_same(data[-1], want[-1], "A1")
    with pytest.raises(IndexError):
        data[len(want)]
    data.close()


def test_several_directories_are_concatenated_in_order(finished: Workflow) -> None:
    dirs = [shard_dir(finished, "A1"), shard_dir(finished, "B2")]
    data = HiddenStateDataset(dirs)
    want = [(r, "A1") for r in direct_reads(dirs[0])] + [(r, "B2") for r in direct_reads(dirs[1])]
    assert len(data) == len(want)
    for i, (ref, dataset) in enumerate(want):
        assert_same(data[i], ref, dataset)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_dataloader_with_two_workers(finished: Workflow, start_method: str) -> None:
    dirs = [shard_dir(finished, "A1"), shard_dir(finished, "B2")]
    data = HiddenStateDataset(dirs, max_open_shards=1)
    data[0]  # the parent holds an open shard before the workers start
    assert data._open, "the parent opened a shard"
    loader = DataLoader(
        data,
        batch_size=3,
        num_workers=2,
        collate_fn=pad_collate,
        multiprocessing_context=start_method,
    )
    want = {r["id"]: r for d in dirs for r in direct_reads(d)}
    seen = []
    for batch in loader:
        b, longest = batch["input_ids"].shape
        assert batch["aux_hidden_states"].shape[:2] == (b, longest)
        assert batch["aux_hidden_states"].dtype == torch.bfloat16
        for j, sample_id in enumerate(batch["id"]):
            n = int(batch["lengths"][j])
            ref = want[sample_id]
            assert batch["attention_mask"][j].sum() == n
            assert np.array_equal(batch["input_ids"][j, :n].numpy(), ref["input_ids"])
            assert not batch["loss_mask"][j, n:].any(), "padding carries no loss"
            got = batch["last_hidden_states"][j, :n]
            assert torch.equal(got.view(torch.int16), ref["last"].view(torch.int16))
            seen.append(sample_id)
    assert sorted(seen) == sorted(want)
    assert len(seen) == len(set(seen))


def test_pickled_dataset_carries_no_open_file(finished: Workflow) -> None:
    data = HiddenStateDataset(shard_dir(finished, "B2"))
    first = data[0]
    copy = pickle.loads(pickle.dumps(data))  # what a spawned worker receives
    assert not copy._open
    assert torch.equal(copy[0]["last_hidden_states"], first["last_hidden_states"])


def test_without_manifest_shards_are_globbed(finished: Workflow, tmp_path: Path) -> None:
    source = shard_dir(finished, "A1")
    copy = tmp_path / "A1"
    copy.mkdir()
    for path in source.glob("shard-*.h5"):
        shutil.copy2(path, copy / path.name)
    (copy / ".shard-00099.h5.host_1.x.tmp").write_bytes(b"partial")  # a killed writer's
    found = find_shards(copy)
    assert [s.path.name for s in found] == sorted(p.name for p in source.glob("shard-*.h5"))
    data = HiddenStateDataset(copy)
    want = direct_reads(source)
    assert [data[i]["id"] for i in range(len(data))] == [r["id"] for r in want]
    assert_same(data[3], want[3], "A1")


def test_a_directory_without_shards_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no manifest\.json and no shard-\*\.h5"):
        HiddenStateDataset(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such directory"):
        HiddenStateDataset(tmp_path / "missing")


def test_a_shard_changed_after_validation_is_refused(finished: Workflow, tmp_path: Path) -> None:
    source = shard_dir(finished, "A1")
    copy = tmp_path / "A1"
    shutil.copytree(source, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["shards"][0]["samples"] += 1
    (copy / "manifest.json").write_text(json.dumps(manifest))
    data = HiddenStateDataset(copy)
    with pytest.raises(ShardFormatError, match="changed after validation"):
        data[0]
