"""Streaming extraction: length-sorted batches written straight to their rows of a shard."""

from __future__ import annotations

import threading
import tracemalloc
from collections.abc import Sequence
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from support.target_models import forward_with_pre_norm

from eagle3data.hidden_states.extraction import extract_into_shard, length_batches
from eagle3data.hidden_states.layers import resolve_aux_layers
from eagle3data.hidden_states.transformers_capture import HiddenStateExtractor
from eagle3data.shards import ShardWriter, open_shard, validate_shard

ROW_DATASETS = ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_states")
ALL_DATASETS = (*ROW_DATASETS, "sample_offsets")


def conversations(n: int, seed: int = 0, lo: int = 3, hi: int = 40):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(lo, hi, size=n)
    ids = [f"conv-{i:03d}" for i in range(n)]
    tokens = [rng.integers(3, 60, size=t).tolist() for t in lengths]
    masks = [[0] * (t // 2) + [1] * (t - t // 2) for t in lengths]
    return ids, tokens, masks


@pytest.fixture(scope="module")
def extractor(tiny_model_dir: Path) -> HiddenStateExtractor:
    return HiddenStateExtractor(str(tiny_model_dir), dtype="float32", device="cpu")


def stream(path: Path, extractor, ids, tokens, masks, **kw) -> Path:
    with ShardWriter(
        path,
        hidden_size=extractor.hidden_size,
        hidden_dtype="float32",
        attrs={"model": "tiny"},
        compression=kw.pop("compression", None),
    ) as writer:
        extract_into_shard(extractor, writer, ids, tokens, masks, **kw)
    return path


def read_all(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        return {name: f[name][()] for name in ALL_DATASETS} | {
            "sample_ids": f["sample_ids"].asstr()[()].tolist()
        }


def assert_same_datasets(a: Path, b: Path) -> None:
    got, want = read_all(a), read_all(b)
    assert got["sample_ids"] == want["sample_ids"]
    for name in ALL_DATASETS:
        assert got[name].dtype == want[name].dtype, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_streamed_shard_equals_the_whole_shard_written_at_the_end(tmp_path, extractor):
    ids, tokens, masks = conversations(9)
    batch_tokens = 80
    batches = length_batches([len(t) for t in tokens], batch_tokens)
    computed_order = [i for batch in batches for i in batch]
    assert len(batches) >= 3 and computed_order != sorted(computed_order)  # really out of order

    streamed = stream(tmp_path / "streamed.h5", extractor, ids, tokens, masks, batch_tokens=80)

    # The former way: every state of the shard in memory, then appended in shard order.
    states: list = [None] * len(ids)
    for batch in batches:
        for i, out in zip(batch, extractor.forward([tokens[i] for i in batch]), strict=True):
            states[i] = out
    with ShardWriter(
        tmp_path / "whole.h5", hidden_size=extractor.hidden_size, hidden_dtype="float32", attrs={}
    ) as w:
        for i, sid in enumerate(ids):
            w.add(sid, tokens[i], masks[i], *states[i])

    assert_same_datasets(streamed, tmp_path / "whole.h5")
    check = validate_shard(streamed, expected_ids=ids, hidden_size=extractor.hidden_size)
    assert check.ok, check.errors


@pytest.fixture(scope="module")
def post_norm_extractor(tiny_model_dir: Path) -> HiddenStateExtractor:
    return HiddenStateExtractor(
        str(tiny_model_dir), dtype="float32", device="cpu", final_state="post_norm"
    )


def test_streamed_states_equal_a_direct_forward(tmp_path, extractor, post_norm_extractor):
    """Aux layers are output_hidden_states[k]; the final state is the last layer's output
    (pre_norm, the default) or output_hidden_states[-1] (post_norm), each unpadded."""
    ids, tokens, masks = conversations(5, seed=1)
    pre_path = stream(tmp_path / "s.h5", extractor, ids, tokens, masks, batch_tokens=64)
    post_path = stream(
        tmp_path / "post.h5", post_norm_extractor, ids, tokens, masks, batch_tokens=64
    )
    indices = extractor.aux.hidden_states_indices
    with open_shard(pre_path) as shard, open_shard(post_path) as post_shard:
        assert shard.sample_ids == ids
        for i, t in enumerate(tokens):
            with torch.inference_mode():
                out = extractor.model(torch.tensor([t]), output_hidden_states=True)
            want_aux = torch.cat([out.hidden_states[k][0] for k in indices], dim=-1)
            got, post = shard.sample(i), post_shard.sample(i)
            assert got["input_ids"].tolist() == t
            assert got["loss_mask"].tolist() == masks[i]
            torch.testing.assert_close(
                torch.from_numpy(got["aux_hidden_states"]), want_aux, rtol=1e-4, atol=1e-4
            )
            np.testing.assert_array_equal(post["aux_hidden_states"], got["aux_hidden_states"])
            torch.testing.assert_close(
                torch.from_numpy(got["last_hidden_states"]),
                forward_with_pre_norm(extractor.model, t)[1],
                rtol=1e-4,
                atol=1e-4,
            )
            torch.testing.assert_close(
                torch.from_numpy(post["last_hidden_states"]),
                out.hidden_states[-1][0],
                rtol=1e-4,
                atol=1e-4,
            )
            assert not np.allclose(got["last_hidden_states"], post["last_hidden_states"])


@pytest.mark.parametrize("compression", ["lzf", "gzip"])
def test_background_and_inline_writes_and_compression_store_the_same_rows(
    tmp_path, extractor, compression
):
    ids, tokens, masks = conversations(7, seed=2)
    inline = stream(
        tmp_path / "inline.h5",
        extractor,
        ids,
        tokens,
        masks,
        batch_tokens=60,
        background_writes=False,
    )
    packed = stream(
        tmp_path / "packed.h5",
        extractor,
        ids,
        tokens,
        masks,
        batch_tokens=60,
        compression=compression,
    )
    assert_same_datasets(inline, packed)
    with h5py.File(packed, "r") as f:
        assert f.attrs["compression"] == compression
        assert f["aux_hidden_states"].compression == compression
    with h5py.File(inline, "r") as f:
        assert f.attrs["compression"] == "none"
        assert f["aux_hidden_states"].chunks is None  # contiguous: rows go straight to disk


class NumpyExtractor:
    """Deterministic states from token ids, as numpy: tracemalloc sees every byte."""

    def __init__(self, hidden_size: int) -> None:
        self.hidden_size = hidden_size
        self.aux = resolve_aux_layers("auto", 8)
        self.dtype = torch.float32
        self.thread_ids: set[int] = set()

    def forward(self, samples: Sequence[Sequence[int]]):
        out = []
        for s in samples:
            base = np.asarray(s, dtype=np.float32)[:, None]
            out.append(
                (
                    np.repeat(base, 3 * self.hidden_size, axis=1),
                    np.repeat(base + 0.5, self.hidden_size, axis=1),
                )
            )
        return out


def test_peak_memory_is_about_two_batches_not_the_shard(tmp_path):
    hidden = 256
    n, length, batch_tokens = 64, 128, 512  # 16 batches of 4 samples
    ids = [f"s{i}" for i in range(n)]
    tokens = [[i + 1] * length for i in range(n)]
    masks = [[1] * length for _ in range(n)]
    batch_bytes = batch_tokens * 4 * hidden * 4
    shard_bytes = n * length * 4 * hidden * 4
    assert shard_bytes == 16 * batch_bytes

    tracemalloc.start()
    try:
        with ShardWriter(
            tmp_path / "s.h5", hidden_size=hidden, hidden_dtype="float32", attrs={}
        ) as writer:
            extract_into_shard(
                NumpyExtractor(hidden), writer, ids, tokens, masks, batch_tokens=batch_tokens
            )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Computing + writing overlap: about two batches (plus small per-row checks), never 16.
    assert peak < 3 * batch_bytes, (peak, batch_bytes, shard_bytes)
    with open_shard(tmp_path / "s.h5") as shard:
        assert shard.sample_ids == ids
        last = shard.sample(37)["last_hidden_states"]
        assert last.shape == (length, hidden) and (last == 38.5).all()


def test_writes_run_on_a_background_thread(tmp_path):
    threads: set[str] = set()

    class Recording(ShardWriter):
        def write_states(self, index, aux, last):
            threads.add(threading.current_thread().name)
            super().write_states(index, aux, last)

    ids, tokens, masks = conversations(6, seed=3)
    with Recording(tmp_path / "s.h5", hidden_size=8, hidden_dtype="float32", attrs={}) as w:
        extract_into_shard(NumpyExtractor(8), w, ids, tokens, masks, batch_tokens=40)
    assert threads and all(name.startswith("shard-writer") for name in threads)
    assert validate_shard(tmp_path / "s.h5", expected_ids=ids).ok


def test_a_failing_forward_leaves_no_shard_and_no_temp_file(tmp_path):
    class Failing(NumpyExtractor):
        calls = 0

        def forward(self, samples):
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("CUDA out of memory")
            return super().forward(samples)

    ids, tokens, masks = conversations(12, seed=4)
    writer = ShardWriter(tmp_path / "s.h5", hidden_size=8, hidden_dtype="float32", attrs={})
    with pytest.raises(RuntimeError, match="out of memory"), writer as w:
        extract_into_shard(Failing(8), w, ids, tokens, masks, batch_tokens=40)
    assert list(tmp_path.iterdir()) == []


def test_a_failing_write_surfaces_and_leaves_no_shard(tmp_path):
    class Broken(ShardWriter):
        def write_states(self, index, aux, last):
            if index == 4:
                raise OSError("No space left on device")
            super().write_states(index, aux, last)

    ids, tokens, masks = conversations(10, seed=5)
    writer = Broken(tmp_path / "s.h5", hidden_size=8, hidden_dtype="float32", attrs={})
    with pytest.raises(OSError, match="No space left"), writer as w:
        extract_into_shard(NumpyExtractor(8), w, ids, tokens, masks, batch_tokens=40)
    assert list(tmp_path.iterdir()) == []


def test_length_batches_cap_padding_once_a_batch_is_a_quarter_full():
    rng = np.random.default_rng(0)
    lengths = rng.integers(32, 2048, size=500).tolist()
    budget = 16384
    batches = length_batches(lengths, budget)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        width = max(lengths[i] for i in b)
        padded, real = width * len(b), sum(lengths[i] for i in b)
        assert padded <= budget or len(b) == 1
        before_last = real - lengths[b[-1]]
        assert padded - real <= 0.1 * padded or before_last < budget // 4, (b, padded, real)
    total_padded = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    assert total_padded / sum(lengths) < 1.05
    # Diverse lengths no longer pad a short sample up to a long one in a full batch.
    assert length_batches([1000, 1000, 300, 300], 4000) == [[0, 1], [2, 3]]
    assert length_batches([100] * 8, 400) == [[0, 1, 2, 3], [4, 5, 6, 7]]
