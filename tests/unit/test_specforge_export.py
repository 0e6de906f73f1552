"""SpecForge export: one torch.save file per conversation, as SpecForge's offline trainer reads."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
from specforge.algorithms.eagle3.data import normalize_offline_sample
from specforge.runtime.data_plane.feature_store import load_feature_file
from specforge.runtime.data_plane.offline_reader import list_feature_files

from eagle3data.consumers.specforge import export_specforge, specforge_file_name
from eagle3data.shards import ShardWriter

H = 8
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def write_dataset(directory: Path, hidden_dtype: str, lengths: list[list[int]]) -> list[dict]:
    """Shards (one per inner list) and a manifest like the validate rule writes."""
    directory.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    samples, entries = [], []
    for k, shard_lengths in enumerate(lengths):
        name = f"shard-{k:05d}.h5"
        with ShardWriter(
            directory / name,
            hidden_size=H,
            hidden_dtype=hidden_dtype,  # type: ignore[arg-type]
            attrs={"dataset": directory.name, "aux_layer_ids": [1, 2, 3]},
        ) as w:
            for t in shard_lengths:
                s = {
                    "sample_id": f"s{len(samples)}",
                    "input_ids": torch.randint(0, 1000, (t,), generator=gen),
                    "loss_mask": torch.arange(t) >= t // 2,
                    "aux_hidden_states": torch.randn(t, 3 * H, generator=gen),
                    "last_hidden_states": torch.randn(t, H, generator=gen),
                }
                w.add(**s)
                samples.append(s)
        entries.append({"file": name, "samples": len(shard_lengths)})
    manifest = {"dataset": directory.name, "shards": entries, "attrs": {"hidden_size": H}}
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return samples


@pytest.mark.parametrize(
    ("hidden_dtype", "export_dtype"),
    [("bfloat16", None), ("float32", None), ("float16", "float16"), ("float32", "float32")],
)
def test_export_matches_the_shards(
    tmp_path: Path, hidden_dtype: str, export_dtype: str | None
) -> None:
    """bf16 by default, whatever the forward dtype (SpecForge trains in bf16 only); any
    export dtype holds the shards' values rounded once."""
    samples = write_dataset(tmp_path / "hs" / "A1", hidden_dtype, [[5, 9, 3], [7], [4, 6]])
    out = tmp_path / "specforge" / "A1"
    export_specforge(
        dataset="A1",
        shard_dir=str(tmp_path / "hs" / "A1"),
        out_dir=str(out),
        work_dir=str(tmp_path / "w"),
        **({} if export_dtype is None else {"dtype": export_dtype}),
    )
    dtype = TORCH_DTYPES[export_dtype or "bfloat16"]
    index = json.loads((out / "index.json").read_text())
    assert index["dtype"] == (export_dtype or "bfloat16")
    assert index["num_samples"] == len(samples)
    assert [s["id"] for s in index["samples"]] == [s["sample_id"] for s in samples]
    for i, s in enumerate(samples):
        path = out / f"rows_0-2000/data_{i}.ckpt"
        assert index["samples"][i]["file"] == f"rows_0-2000/data_{i}.ckpt"
        # weights_only: plain tensors only, nothing pickled that needs trust.
        raw = torch.load(path, weights_only=True, mmap=True)
        assert set(raw) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        t = len(s["input_ids"])
        assert raw["input_ids"].dtype == raw["loss_mask"].dtype == torch.int64
        assert torch.equal(raw["input_ids"], s["input_ids"])
        assert torch.equal(raw["loss_mask"], s["loss_mask"].long())
        assert raw["hidden_state"].shape == (1, t, H) and raw["hidden_state"].dtype == dtype
        assert raw["aux_hidden_state"].shape == (1, t, 3 * H)
        assert raw["aux_hidden_state"].dtype == dtype
        # The shard's values, rounded once to the export dtype.
        stored = TORCH_DTYPES[hidden_dtype]
        last, aux = (s[k].to(stored).to(dtype) for k in ("last_hidden_states", "aux_hidden_states"))
        assert torch.equal(raw["hidden_state"][0], last)
        assert torch.equal(raw["aux_hidden_state"][0], aux)
        # Only this conversation's bytes: no padding, no shared storage saved along.
        assert raw["aux_hidden_state"].untyped_storage().nbytes() == t * 3 * H * dtype.itemsize
    assert not list((tmp_path / "w").iterdir()), "the temporary directory was renamed away"


def test_specforge_reader_accepts_the_export(tmp_path: Path) -> None:
    samples = write_dataset(tmp_path / "hs" / "B2", "bfloat16", [[6, 4], [9]])
    out = tmp_path / "specforge" / "B2"
    export_specforge(
        dataset="B2",
        shard_dir=str(tmp_path / "hs" / "B2"),
        out_dir=str(out),
        work_dir=str(tmp_path / "w"),
    )
    files = list_feature_files(str(tmp_path / "specforge"))  # the parent: every dataset's
    assert len(files) == len(samples)
    for path in files:
        raw = load_feature_file(path)
        ready = normalize_offline_sample(raw, max_len=5)
        n = min(5, raw["input_ids"].numel())
        for key in ("input_ids", "loss_mask", "attention_mask"):
            assert ready[key].shape == (1, n)
        assert ready["hidden_state"].shape == (1, n, 3 * H)
        assert ready["target"].shape == (1, n, H)


def test_file_names_follow_specforge_groups() -> None:
    assert specforge_file_name(0) == "rows_0-2000/data_0.ckpt"
    assert specforge_file_name(1999) == "rows_0-2000/data_1999.ckpt"
    assert specforge_file_name(2000) == "rows_2000-4000/data_2000.ckpt"
    assert specforge_file_name(7, group_size=3) == "rows_6-9/data_7.ckpt"


def test_a_failed_export_leaves_nothing(tmp_path: Path) -> None:
    write_dataset(tmp_path / "hs" / "A1", "bfloat16", [[5, 5]])
    (tmp_path / "hs" / "A1" / "shard-00000.h5").write_bytes(b"not hdf5")
    out = tmp_path / "specforge" / "A1"
    work = tmp_path / "w"
    # A temporary left by a killed writer (no such pid) is cleaned up on the next run.
    stale = work / f"A1.{socket.gethostname()}_999999999.tmp"
    stale.mkdir(parents=True)
    (stale / "data_0.ckpt").write_bytes(b"partial")
    with pytest.raises(OSError):
        export_specforge(
            dataset="A1",
            shard_dir=str(tmp_path / "hs" / "A1"),
            out_dir=str(out),
            work_dir=str(work),
        )
    assert not out.exists()
    assert not list(work.iterdir())


def test_export_replaces_an_existing_directory(tmp_path: Path) -> None:
    write_dataset(tmp_path / "hs" / "A1", "float32", [[3]])
    out = tmp_path / "specforge" / "A1"
    (out / "rows_0-2000").mkdir(parents=True)
    (out / "rows_0-2000" / "data_5.ckpt").write_bytes(b"old")
    export_specforge(
        dataset="A1",
        shard_dir=str(tmp_path / "hs" / "A1"),
        out_dir=str(out),
        work_dir=str(tmp_path / "w"),
    )
    assert sorted(p.name for p in (out / "rows_0-2000").iterdir()) == ["data_0.ckpt"]
