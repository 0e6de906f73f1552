"""Hidden states stored as scaled FP8 (``hidden_states.storage_dtype: float8_e4m3fn``):
the format, its error, the validator, and every consumer (loader, SpecForge export, vocab)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import h5py
import numpy as np
import polars as pl
import pytest
import torch
from support.settings import capture_settings

from eagle3data.consumers.specforge import export_specforge
from eagle3data.consumers.vocab import build_draft_vocab, draft_vocab
from eagle3data.hidden_states.settings import hidden_state_settings
from eagle3data.loader import HiddenStateDataset, pad_collate
from eagle3data.shards import (
    FP8_BLOCK_SIZE,
    FP8_DTYPE,
    ShardFormatError,
    ShardWriter,
    bytes_per_token,
    encoding,
    open_shard,
    validate_shard,
)

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Half a float8 e4m3 step: the largest relative rounding error of one normal value.
FP8_HALF_STEP = 2.0**-4


def states(t: int, h: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Aux [t, 3h] with the magnitudes real models show: layers of very different scale
    and one massive-activation channel (as SmolLM2's channel 507: 25600 vs a median of 2)."""
    gen = torch.Generator().manual_seed(seed)
    aux = torch.randn(t, 3 * h, generator=gen)
    aux *= torch.tensor([0.8, 2.0, 8.0]).repeat_interleave(h)
    aux[:, h + 3] = 25600.0  # massive channel in the mid layer
    aux[:, 2 * h + 3] = -25000.0
    aux[0] *= 40  # an attention-sink-like first token
    last = torch.randn(t, h, generator=gen)
    last[:, 5] = 59.0
    return aux, last


def write(
    path: Path,
    samples: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    h: int,
    hidden_dtype: str = "bfloat16",
    storage_dtype: str | None = FP8_DTYPE,
    numpy_input: bool = False,
    **kw,
) -> Path:
    with ShardWriter(
        path,
        hidden_size=h,
        hidden_dtype=hidden_dtype,  # type: ignore[arg-type]
        storage_dtype=storage_dtype,  # type: ignore[arg-type]
        attrs={"dataset": path.parent.name, "aux_layer_ids": [1, 2, 3]},
        **kw,
    ) as w:
        for i, (aux, last) in enumerate(samples):
            t = aux.shape[0]
            ids = torch.arange(i, i + t) % 50
            mask = torch.arange(t) >= t // 2
            if numpy_input:
                w.add(f"s{i}", ids.numpy(), mask.numpy(), aux.numpy(), last.numpy())
            else:
                w.add(f"s{i}", ids, mask, aux, last)
    return path


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (got.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)


# --------------------------------------------------------------------------- format, error


@pytest.mark.parametrize("h", [160, 256])  # ragged (128 + 32) and whole 128-channel blocks
def test_round_trip_error_is_bounded_and_block_maxima_are_exact(tmp_path: Path, h: int) -> None:
    aux, last = states(40, h)
    path = write(tmp_path / "s.h5", [(aux[:15], last[:15]), (aux[15:], last[15:])], h=h)
    ref_aux, ref_last = aux.to(torch.bfloat16), last.to(torch.bfloat16)  # the forward dtype
    with open_shard(path) as shard:
        assert (shard.hidden_dtype, shard.storage_dtype) == ("bfloat16", FP8_DTYPE)
        got_aux = shard.aux_hidden_states(as_torch=True)
        got_last = shard.last_hidden_states(as_torch=True)
        assert got_aux.dtype == got_last.dtype == torch.bfloat16
        assert got_aux.shape == (40, 3 * h) and got_last.shape == (40, h)
        # numpy gives the same values as float32
        assert np.array_equal(shard.aux_hidden_states(), got_aux.float().numpy())
        assert np.array_equal(shard.sample(1)["last_hidden_states"], got_last[15:].float().numpy())
    for got, ref in ((got_aux, ref_aux), (got_last, ref_last)):
        err = rel_l2(got, ref)
        assert err.max() < FP8_HALF_STEP and err.median() < 0.035
        cos = torch.nn.functional.cosine_similarity(got.float(), ref.float(), dim=-1)
        assert cos.min() > 0.998
    # Each layer on its own too: the massive channels do not swamp the small first layer.
    for k in range(3):
        cols = slice(k * h, (k + 1) * h)
        assert rel_l2(got_aux[:, cols], ref_aux[:, cols]).max() < FP8_HALF_STEP
    # The largest value of every block is stored exactly (it maps to 448).
    assert torch.equal(got_aux[:, h + 3], ref_aux[:, h + 3])
    assert torch.equal(got_last[:, 5], ref_last[:, 5])


def test_layout_and_attributes(tmp_path: Path) -> None:
    h = 160
    path = write(tmp_path / "s.h5", [states(7, h)], h=h)
    with h5py.File(path, "r") as f:
        assert f.attrs["format_version"] == 2
        assert f.attrs["hidden_dtype"] == "bfloat16"
        assert f.attrs["storage_dtype"] == "float8_e4m3fn"
        assert f.attrs["hidden_encoding"] == "scaled-float8_e4m3fn-bits-as-uint8"
        assert f.attrs["scale_granularity"] == "token_block"
        assert f.attrs["scale_block_size"] == FP8_BLOCK_SIZE == 128
        assert f["aux_hidden_states"].dtype == f["last_hidden_states"].dtype == np.uint8
        assert f["aux_hidden_states"].shape == (7, 3 * h)
        assert f["aux_hidden_states_scale"].dtype == np.float32
        assert f["aux_hidden_states_scale"].shape == (7, 3 * 2)  # blocks of 128 and 32 per layer
        assert f["last_hidden_states_scale"].shape == (7, 2)
        assert (f["aux_hidden_states_scale"][()] > 0).all()


def test_a_block_size_above_h_is_one_scale_per_layer(tmp_path: Path) -> None:
    path = write(tmp_path / "s.h5", [states(4, 16)], h=16)
    with h5py.File(path, "r") as f:
        assert f.attrs["scale_block_size"] == 16
        assert f["aux_hidden_states_scale"].shape == (4, 3)
        assert f["last_hidden_states_scale"].shape == (4, 1)
    assert validate_shard(path).ok


def test_docstring_recipe_reads_without_this_module(tmp_path: Path) -> None:
    h = 160
    path = write(tmp_path / "s.h5", [states(9, h)], h=h)
    with h5py.File(path, "r") as f:
        u8, scale = f["aux_hidden_states"][:], f["aux_hidden_states_scale"][:]
        x8 = torch.from_numpy(u8).view(torch.float8_e4m3fn).float()
        block, hidden = int(f.attrs["scale_block_size"]), int(f.attrs["hidden_size"])
        widths = [min(block, hidden - j) for j in range(0, hidden, block)] * 3
        x = x8 * torch.from_numpy(scale).repeat_interleave(torch.tensor(widths), dim=1)
        x = x.to(torch.bfloat16)
    with open_shard(path) as shard:
        assert torch.equal(x, shard.aux_hidden_states(as_torch=True))


@pytest.mark.parametrize("hidden_dtype", ["bfloat16", "float16", "float32"])
def test_reads_return_the_forward_dtype(tmp_path: Path, hidden_dtype: str) -> None:
    aux, last = states(6, 16)
    aux[:, 16 + 3] = 2000.0  # float16 range
    aux[:, 32 + 3] = -2000.0
    path = write(tmp_path / "s.h5", [(aux, last)], h=16, hidden_dtype=hidden_dtype)
    with open_shard(path) as shard:
        got = shard.aux_hidden_states(as_torch=True)
        assert got.dtype == TORCH_DTYPES[hidden_dtype]
        assert rel_l2(got, aux).max() < FP8_HALF_STEP
        # numpy, as for unscaled shards: float32 for bf16 (numpy has none), else the dtype
        numpy_dtype = np.float32 if hidden_dtype == "bfloat16" else np.dtype(hidden_dtype)
        assert shard.last_hidden_states().dtype == numpy_dtype


def test_torch_and_numpy_inputs_write_the_same_bits(tmp_path: Path) -> None:
    samples = [states(9, 160, seed=1), states(4, 160, seed=2)]
    a = write(tmp_path / "a.h5", samples, h=160)
    b = write(tmp_path / "b.h5", samples, h=160, numpy_input=True)
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        for name in ("aux_hidden_states", "last_hidden_states"):
            for suffix in ("", "_scale"):
                assert np.array_equal(fa[name + suffix][()], fb[name + suffix][()])


def test_numpy_float8_rounding_matches_torch_on_every_boundary() -> None:
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(values, encoding.FP8_VALUES, equal_nan=True)
    grid = np.unique(np.abs(values[np.isfinite(values)]))
    mid = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(np.float32)  # exact ties
    x = np.concatenate(
        [grid, mid, np.nextafter(mid, 0), np.nextafter(mid, np.inf), [0.0, 1e-9, 448.0]]
    ).astype(np.float32)
    x = np.concatenate([x, -x, [np.nan]]).astype(np.float32)
    want = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(encoding.float32_to_fp8_bits(x), want)


def test_zero_rows_are_stored_with_unit_scales(tmp_path: Path) -> None:
    aux, last = torch.zeros(3, 48), torch.zeros(3, 16)
    path = write(tmp_path / "s.h5", [(aux, last)], h=16)
    with h5py.File(path, "r") as f:
        assert (f["aux_hidden_states_scale"][()] == 1).all()
    with open_shard(path) as shard:
        assert not shard.aux_hidden_states().any()
    assert validate_shard(path).ok


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("numpy_input", [False, True])
def test_writer_rejects_non_finite_states(tmp_path: Path, bad: float, numpy_input: bool) -> None:
    aux, last = states(5, 16)
    aux[2, 40] = bad
    with pytest.raises(ShardFormatError, match="aux_hidden_states has non-finite values in 1 of 5"):
        write(tmp_path / "s.h5", [(aux, last)], h=16, numpy_input=numpy_input)
    assert not (tmp_path / "s.h5").exists()


def test_float16_overflow_is_refused_before_quantizing(tmp_path: Path) -> None:
    aux, last = states(5, 16)
    aux[1, 0] = 1e6  # inf in the float16 forward dtype
    with pytest.raises(ShardFormatError, match="non-finite"):
        write(tmp_path / "s.h5", [(aux, last)], h=16, hidden_dtype="float16")


def test_writer_refuses_other_storage_dtypes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="storage_dtype"):
        ShardWriter(
            tmp_path / "s.h5",
            hidden_size=8,
            hidden_dtype="bfloat16",
            storage_dtype="float16",  # type: ignore[arg-type]
            attrs={},
        )


@pytest.mark.parametrize("compression", ["gzip", "lzf"])
def test_compressed_and_streamed_float8_shards(tmp_path: Path, compression: str) -> None:
    samples = [states(n, 160, seed=n) for n in (7, 3, 11)]
    appended = write(tmp_path / "a.h5", samples, h=160)
    streamed = tmp_path / "b.h5"
    with ShardWriter(
        streamed,
        hidden_size=160,
        hidden_dtype="bfloat16",
        storage_dtype=FP8_DTYPE,
        attrs={"dataset": "x", "aux_layer_ids": [1, 2, 3]},
        compression=compression,
    ) as w:
        w.declare_samples(
            [f"s{i}" for i in range(3)],
            [torch.arange(i, i + a.shape[0]) % 50 for i, (a, _) in enumerate(samples)],
            [torch.arange(a.shape[0]) >= a.shape[0] // 2 for a, _ in samples],
        )
        for i in (2, 0, 1):
            w.write_states(i, *samples[i])
    assert validate_shard(streamed).ok
    with open_shard(appended) as a, open_shard(streamed) as b:
        assert torch.equal(a.aux_hidden_states(as_torch=True), b.aux_hidden_states(as_torch=True))
        assert torch.equal(a.last_hidden_states(as_torch=True), b.last_hidden_states(as_torch=True))


# --------------------------------------------------------------------------- bytes


def test_bytes_per_token_is_about_half_of_bf16() -> None:
    for h, blocks in ((576, 5), (4096, 32), (7168, 56)):
        fp8 = bytes_per_token(h, "bfloat16", FP8_DTYPE)
        assert fp8 == 4 * h + 4 * blocks * 4 + 5
        assert fp8 / bytes_per_token(h, "bfloat16") <= 0.52
    assert bytes_per_token(576, "bfloat16", "auto") == bytes_per_token(576, "bfloat16")
    with pytest.raises(ValueError, match="storage_dtype"):
        bytes_per_token(576, "bfloat16", "int8")


def test_bytes_per_token_matches_the_streamed_file(tmp_path: Path) -> None:
    h, n, k = 576, 8, 256
    path = tmp_path / "s.h5"
    with ShardWriter(
        path, hidden_size=h, hidden_dtype="bfloat16", storage_dtype=FP8_DTYPE, attrs={}
    ) as w:
        w.declare_samples(
            [f"s{i}" for i in range(n)],
            [torch.arange(k)] * n,
            [torch.ones(k, dtype=torch.bool)] * n,
        )
        for i in range(n):
            w.write_states(i, *states(k, h, seed=i))
    ideal = n * k * bytes_per_token(h, "bfloat16", FP8_DTYPE)
    # Only HDF5 metadata on top, as for unscaled shards.
    assert ideal <= path.stat().st_size < ideal + 64 * 1024


# --------------------------------------------------------------------------- old shards, validator


def write_v1_shard(path: Path, h: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """A shard as version 1 wrote it (before storage_dtype existed), without this module."""
    gen = np.random.default_rng(0)
    aux = gen.standard_normal((6, 3 * h)).astype(np.float32)
    last = gen.standard_normal((6, h)).astype(np.float32)
    as_bits = encoding.float32_to_bf16_bits
    with h5py.File(path, "w") as f:
        f.attrs.update(
            format="eagle3-hidden-states",
            format_version=1,
            hidden_dtype="bfloat16",
            hidden_encoding="bfloat16-bits-as-uint16",
            hidden_size=h,
            compression="none",
            dataset=path.parent.name,
            num_samples=2,
            num_tokens=6,
        )
        f["input_ids"] = np.arange(6, dtype=np.int32)
        f["loss_mask"] = np.array([0, 1, 1, 0, 0, 1], dtype=np.uint8)
        f["aux_hidden_states"] = as_bits(aux)
        f["last_hidden_states"] = as_bits(last)
        f["sample_offsets"] = np.array([0, 2, 6], dtype=np.int64)
        f.create_dataset(
            "sample_ids", data=np.array(["a", "b"], dtype=object), dtype=h5py.string_dtype()
        )
    return aux, last


def test_version_1_shards_still_read_and_validate(tmp_path: Path) -> None:
    directory = tmp_path / "A1"
    directory.mkdir()
    aux, last = write_v1_shard(directory / "shard-00000.h5")
    assert validate_shard(directory / "shard-00000.h5").ok
    with open_shard(directory / "shard-00000.h5") as shard:
        assert (shard.hidden_dtype, shard.storage_dtype) == ("bfloat16", "bfloat16")
        want = torch.from_numpy(aux).to(torch.bfloat16)
        assert torch.equal(shard.aux_hidden_states(as_torch=True), want)
    item = HiddenStateDataset(directory)[1]
    assert item["last_hidden_states"].dtype == torch.bfloat16
    assert torch.equal(item["last_hidden_states"], torch.from_numpy(last[2:]).to(torch.bfloat16))


def test_unscaled_shards_are_still_written_as_version_1(tmp_path: Path) -> None:
    path = write(tmp_path / "s.h5", [states(3, 8)], h=8, storage_dtype=None)
    with h5py.File(path, "r") as f:
        assert f.attrs["format_version"] == 1
        assert f.attrs["storage_dtype"] == "bfloat16"
        assert "aux_hidden_states_scale" not in f


@pytest.fixture
def fp8_shard(tmp_path: Path) -> Path:
    return write(tmp_path / "s.h5", [states(5, 160), states(4, 160, seed=1)], h=160)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_validator_rejects_a_corrupted_scale(fp8_shard: Path, bad: float) -> None:
    assert validate_shard(fp8_shard).ok
    with h5py.File(fp8_shard, "r+") as f:
        f["aux_hidden_states_scale"][6, 2] = bad  # a token of the second sample
    check = validate_shard(fp8_shard)
    assert check.errors == (
        "aux_hidden_states_scale: sample 's1' has non-finite or non-positive scales",
    )


def test_validator_rejects_float8_nan_bits(fp8_shard: Path) -> None:
    with h5py.File(fp8_shard, "r+") as f:
        f["last_hidden_states"][1, 7] = 0xFF  # -NaN in e4m3fn
    check = validate_shard(fp8_shard)
    assert check.errors == ("last_hidden_states: sample 's0' has non-finite values",)


def test_validator_rejects_scales_of_the_wrong_shape(fp8_shard: Path) -> None:
    with h5py.File(fp8_shard, "r+") as f:
        scale = f["last_hidden_states_scale"][()]
        del f["last_hidden_states_scale"]
        f["last_hidden_states_scale"] = scale[:, :1]
    check = validate_shard(fp8_shard)
    assert check.errors == ("last_hidden_states_scale: shape (9, 1), expected (9, 2)",)


def test_validator_and_reader_reject_a_missing_scale_dataset(fp8_shard: Path) -> None:
    with h5py.File(fp8_shard, "r+") as f:
        del f["aux_hidden_states_scale"]
    assert validate_shard(fp8_shard).errors == ("missing datasets ['aux_hidden_states_scale']",)
    with pytest.raises(ShardFormatError, match="aux_hidden_states_scale"):
        open_shard(fp8_shard)


@pytest.mark.parametrize(
    ("attr", "value", "message"),
    [
        ("format_version", 1, "attr format_version=1, but float8_e4m3fn storage is version 2"),
        (
            "hidden_encoding",
            "bfloat16-bits-as-uint16",
            "attr hidden_encoding='bfloat16-bits-as-uint16', expected "
            "'scaled-float8_e4m3fn-bits-as-uint8' for float8_e4m3fn",
        ),
        (
            "scale_granularity",
            "channel",
            "attr scale_granularity='channel', expected 'token_block'",
        ),
        ("scale_block_size", 0, "attr scale_block_size=0, expected a positive integer"),
        ("storage_dtype", "int8", "attr storage_dtype='int8', expected 'bfloat16' or"),
    ],
)
def test_validator_rejects_inconsistent_float8_attributes(
    fp8_shard: Path, attr: str, value, message: str
) -> None:
    with h5py.File(fp8_shard, "r+") as f:
        f.attrs[attr] = value
    errors = validate_shard(fp8_shard).errors
    assert errors and errors[0].startswith(message)
    with pytest.raises(ShardFormatError):
        open_shard(fp8_shard)


# --------------------------------------------------------------------------- consumers


def write_dataset(directory: Path, lengths: list[list[int]], h: int = 16) -> list[tuple]:
    """FP8 shards (one per inner list) and a manifest as the validate rule writes it."""
    directory.mkdir(parents=True)
    samples, entries = [], []
    for k, shard_lengths in enumerate(lengths):
        shard_samples = [states(t, h, seed=len(samples) + j) for j, t in enumerate(shard_lengths)]
        name = f"shard-{k:05d}.h5"
        with ShardWriter(
            directory / name,
            hidden_size=h,
            hidden_dtype="bfloat16",
            storage_dtype=FP8_DTYPE,
            attrs={"dataset": directory.name},
        ) as w:
            for aux, last in shard_samples:
                t = aux.shape[0]
                ids = torch.arange(t) * 7 % 23
                mask = torch.arange(t) % 3 != 0
                w.add(f"s{len(samples)}", ids, mask, aux, last)
                samples.append((ids, mask, aux, last))
        entries.append({"file": name, "samples": len(shard_lengths)})
        check = validate_shard(directory / name)
        assert check.ok, check.errors
    with open_shard(directory / entries[0]["file"]) as first:
        attrs = {k: v for k, v in first.attrs.items() if k not in ("num_samples", "num_tokens")}
    manifest = {"dataset": directory.name, "shards": entries, "attrs": attrs}
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return samples


def test_loader_returns_dequantized_states(tmp_path: Path) -> None:
    samples = write_dataset(tmp_path / "A1", [[5, 9], [7]])
    ds = HiddenStateDataset(tmp_path / "A1")
    assert len(ds) == 3
    for i, (ids, mask, aux, last) in enumerate(samples):
        item = ds[i]
        assert item["input_ids"].tolist() == ids.tolist()
        assert item["loss_mask"].tolist() == mask.long().tolist()
        assert item["aux_hidden_states"].dtype == item["last_hidden_states"].dtype == torch.bfloat16
        assert item["aux_hidden_states"].shape == aux.shape
        assert item["last_hidden_states"].shape == last.shape
        assert rel_l2(item["aux_hidden_states"], aux).max() < FP8_HALF_STEP
        assert rel_l2(item["last_hidden_states"], last).max() < FP8_HALF_STEP
    batch = pad_collate([ds[0], ds[1]])
    assert batch["aux_hidden_states"].shape == (2, 9, 48)
    assert batch["aux_hidden_states"].dtype == torch.bfloat16


def test_specforge_export_writes_dequantized_states(tmp_path: Path) -> None:
    samples = write_dataset(tmp_path / "hs" / "A1", [[5, 9], [7]])
    out = tmp_path / "specforge" / "A1"
    export_specforge(
        dataset="A1",
        shard_dir=str(tmp_path / "hs" / "A1"),
        out_dir=str(out),
        work_dir=str(tmp_path / "w"),
    )
    index = json.loads((out / "index.json").read_text())
    assert index["attrs"]["storage_dtype"] == FP8_DTYPE
    ds = HiddenStateDataset(tmp_path / "hs" / "A1")
    for i, (ids, _mask, aux, last) in enumerate(samples):
        raw = torch.load(out / index["samples"][i]["file"], weights_only=True)
        assert raw["input_ids"].dtype == raw["loss_mask"].dtype == torch.int64
        assert raw["input_ids"].tolist() == ids.tolist()
        assert raw["hidden_state"].dtype == raw["aux_hidden_state"].dtype == torch.bfloat16
        assert raw["aux_hidden_state"].shape == (1, *aux.shape)
        assert raw["hidden_state"].shape == (1, *last.shape)
        assert torch.equal(raw["aux_hidden_state"][0], ds[i]["aux_hidden_states"])
        assert rel_l2(raw["hidden_state"][0], last).max() < FP8_HALF_STEP


def test_draft_vocab_from_float8_shards_equals_the_tokenized_one(tmp_path: Path) -> None:
    """The vocab is built from the tokenized table; an FP8 shard holds the same tokens
    and masks, so counting its supervised tokens gives the same d2t / t2d."""
    samples = write_dataset(tmp_path / "A1", [[5, 9], [7, 4]])
    tokenized = tmp_path / "A1.parquet"
    pl.DataFrame(
        {
            "id": [f"s{i}" for i in range(len(samples))],
            "input_ids": [s[0].tolist() for s in samples],
            "loss_mask": [s[1].int().tolist() for s in samples],
        },
        schema={"id": pl.String, "input_ids": pl.List(pl.Int32), "loss_mask": pl.List(pl.UInt8)},
    ).write_parquet(tokenized)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 30}))
    build_draft_vocab(
        datasets=["A1"],
        tokenized_paths=[str(tokenized)],
        model_path=str(model),
        size=6,
        out_mapping=str(tmp_path / "vocab" / "draft_vocab.pt"),
        out_summary=str(tmp_path / "vocab" / "draft_vocab.json"),
    )
    built = torch.load(tmp_path / "vocab" / "draft_vocab.pt", weights_only=True)
    counts: Counter[int] = Counter()
    for item in HiddenStateDataset(tmp_path / "A1"):
        counts.update(item["input_ids"][item["loss_mask"].bool()].tolist())
    from_shards = draft_vocab(counts, 6, 30)
    assert torch.equal(from_shards.d2t, built["d2t"])
    assert torch.equal(from_shards.t2d, built["t2d"])


# --------------------------------------------------------------------------- pipeline


def test_storage_dtype_is_part_of_the_settings_only_when_set() -> None:
    config = {
        "model": {"dtype": "auto"},
        "hidden_states": {"dtype": "auto", "storage_dtype": "auto", "gpus_per_job": 1},
    }
    # The default stores what was stored before: existing runs re-extract nothing.
    assert hidden_state_settings(config) == {"hidden_states": {"dtype": "auto"}, "dtype": "auto"}
    config["hidden_states"]["storage_dtype"] = FP8_DTYPE
    fp8 = hidden_state_settings(config)
    assert fp8["hidden_states"]["storage_dtype"] == FP8_DTYPE  # a change re-extracts


TOK_STATS = {
    "tokenizer_hash": "t",
    "chat_template_hash": "c",
    "max_seq_len": 4096,
    "reasoning": "keep",
}


def test_plan_and_extract_store_float8(tmp_path: Path, tiny_model_dir: Path) -> None:
    from eagle3data.hidden_states.extraction import ShardJob, extract_shard
    from eagle3data.hidden_states.planning import plan_shards

    lengths = [12, 30, 7, 21]
    tokenized = tmp_path / "t.parquet"
    pl.DataFrame(
        {
            "id": [f"c{i}" for i in range(len(lengths))],
            "num_tokens": lengths,
            "input_ids": [[(3 + i + 5 * j) % 60 for j in range(n)] for i, n in enumerate(lengths)],
            "loss_mask": [[j % 2 for j in range(n)] for n in lengths],
        },
        schema_overrides={"loss_mask": pl.List(pl.Int8)},
    ).write_parquet(tokenized)
    stats = tokenized.with_suffix(".stats.json")
    stats.write_text(json.dumps(TOK_STATS))
    hidden_cfg = {
        "aux_layers": "auto",
        "aux_layer_convention": "layer_output",
        "dtype": "float32",
        "device": "cpu",
        "batch_tokens": 64,
        "shard_bytes": 40 * bytes_per_token(64, "float32"),
    }
    shard_paths = {}
    for storage in ("auto", FP8_DTYPE):
        capture = capture_settings(**hidden_cfg, storage_dtype=storage)
        root = tmp_path / storage
        per_token = bytes_per_token(64, "float32", storage)
        plan_shards(
            dataset="A1",
            tokenized_path=str(tokenized),
            tokenize_stats_path=str(stats),
            model_path=str(tiny_model_dir),
            capture=capture,
            out_plan=str(root / "plan.json"),
            spec_dir=str(root / "specs"),
        )
        plan = json.loads((root / "plan.json").read_text())
        assert plan["bytes_per_token"] == per_token
        assert plan["storage_dtype"] == ("float32" if storage == "auto" else FP8_DTYPE)
        # FP8 shards hold ~4x the tokens of float32 ones in the same shard_bytes.
        assert len(plan["shards"]) == (1 if storage == FP8_DTYPE else 3)
        shard_paths[storage] = root / "shard-00000.h5"
        job = ShardJob(
            dataset="A1",
            shard=0,
            spec_path=str(root / "specs" / "shard-00000.json"),
            tokenized_path=str(tokenized),
            tokenize_stats_path=str(stats),
            out_shard=str(shard_paths[storage]),
            model_path=str(tiny_model_dir),
            model_label="tiny",
        )
        extract_shard(job, capture, threads=1)
        assert validate_shard(shard_paths[storage]).ok
    with open_shard(shard_paths["auto"]) as ref, open_shard(shard_paths[FP8_DTYPE]) as fp8:
        assert fp8.storage_dtype == FP8_DTYPE and fp8.hidden_dtype == "float32"
        assert fp8.attrs["compute_dtype"] == "float32"
        n = ref.num_tokens
        for name in ("aux_hidden_states", "last_hidden_states"):
            want = getattr(ref, name)(as_torch=True)
            got = getattr(fp8, name)(slice(0, n), as_torch=True)
            assert got.dtype == torch.float32
            assert rel_l2(got, want).max() < FP8_HALF_STEP
