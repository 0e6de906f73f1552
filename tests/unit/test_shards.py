import hashlib
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from eagle3data import shards
from eagle3data.hidden_states.layers import resolve_aux_layers
from eagle3data.shards import (
    FORMAT_NAME,
    FORMAT_VERSION,
    ShardFormatError,
    ShardWriter,
    bytes_per_token,
    encoding,
    file_sha256,
    open_shard,
    validate_shard,
)
from eagle3data.shards import validation as shard_validation

H = 16
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
ATTRS = {"model": "tiny-test-model", "final_state": "post_norm", "max_seq_len": 64}


def make_samples(n: int = 3, hidden: int = H, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        t = 5 + 3 * i
        mask = torch.zeros(t, dtype=torch.bool)
        mask[t // 2 :] = True
        samples.append(
            {
                "sample_id": f"conv-{i}",
                "input_ids": torch.randint(0, 50_000, (t,), generator=gen),
                "loss_mask": mask,
                "aux_hidden_states": torch.randn(t, 3 * hidden, generator=gen) * 4,
                "last_hidden_states": torch.randn(t, hidden, generator=gen) * 4,
            }
        )
    return samples


def write_shard(path: Path, samples: list[dict], hidden_dtype: str = "bfloat16", **kw) -> Path:
    with ShardWriter(path, hidden_size=H, hidden_dtype=hidden_dtype, attrs=ATTRS, **kw) as w:
        for s in samples:
            w.add(**s)
    return path


@pytest.fixture
def shard_path(tmp_path: Path) -> Path:
    return write_shard(tmp_path / "shard-00000.h5", make_samples())


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# --------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("hidden_dtype", ["bfloat16", "float16", "float32"])
def test_round_trip(tmp_path: Path, hidden_dtype: str):
    samples = make_samples()
    path = write_shard(tmp_path / "s.h5", samples, hidden_dtype)
    dtype = TORCH_DTYPES[hidden_dtype]

    with open_shard(path) as shard:
        assert shard.num_samples == len(shard) == 3
        assert shard.sample_ids == ["conv-0", "conv-1", "conv-2"]
        assert shard.sample_offsets.tolist() == [0, 5, 13, 24]
        assert shard.num_tokens == 24
        assert shard.input_ids.dtype == np.int32
        assert shard.loss_mask.dtype == np.uint8
        assert shard.hidden_dtype == hidden_dtype
        assert shard.hidden_size == H

        for i, s in enumerate(samples):
            got = shard.sample(i)
            assert got["id"] == s["sample_id"]
            np.testing.assert_array_equal(got["input_ids"], s["input_ids"].numpy())
            np.testing.assert_array_equal(got["loss_mask"], s["loss_mask"].numpy())
            for name in ("aux_hidden_states", "last_hidden_states"):
                want = s[name].to(dtype)
                # numpy: bf16 decoded to float32, otherwise the stored dtype; exact either way.
                np.testing.assert_array_equal(
                    got[name], want.float().numpy().astype(got[name].dtype)
                )
                assert got[name].dtype == (
                    np.float32 if hidden_dtype == "bfloat16" else dtype_np(dtype)
                )

        rows = slice(5, 13)
        aux_t = shard.aux_hidden_states(rows, as_torch=True)
        last_t = shard.last_hidden_states(rows, as_torch=True)
        assert aux_t.dtype == dtype and last_t.dtype == dtype
        # Bit-exact: compare the raw bits, so -0.0 vs 0.0 or rounding slips cannot hide.
        assert torch.equal(bits(aux_t), bits(samples[1]["aux_hidden_states"].to(dtype)))
        assert torch.equal(bits(last_t), bits(samples[1]["last_hidden_states"].to(dtype)))
        assert torch.equal(shard.aux_hidden_states(as_torch=True)[5:13], aux_t)


def dtype_np(dtype: torch.dtype) -> np.dtype:
    return {torch.float16: np.dtype(np.float16), torch.float32: np.dtype(np.float32)}[dtype]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def test_bf16_source_tensors_are_stored_bit_for_bit(tmp_path: Path):
    samples = make_samples()
    for s in samples:
        s["aux_hidden_states"] = s["aux_hidden_states"].to(torch.bfloat16)
        s["last_hidden_states"] = s["last_hidden_states"].to(torch.bfloat16)
    path = write_shard(tmp_path / "s.h5", samples, "bfloat16")
    with open_shard(path) as shard:
        stored = shard.aux_hidden_states(as_torch=True)
    want = torch.cat([s["aux_hidden_states"] for s in samples])
    assert torch.equal(bits(stored), bits(want))


def test_docstring_read_recipes_work(shard_path: Path):
    numpy_recipe = "x = (u16.astype(np.uint32) << 16).view(np.float32)"
    torch_recipe = "t = torch.from_numpy(u16.view(np.int16)).view(torch.bfloat16)"
    assert numpy_recipe in shards.__doc__
    assert torch_recipe in shards.__doc__

    with h5py.File(shard_path, "r") as f:
        assert f.attrs["hidden_encoding"] == "bfloat16-bits-as-uint16"
        u16 = f["aux_hidden_states"][:]
    assert u16.dtype == np.uint16
    scope = {"np": np, "torch": torch, "u16": u16}
    exec(numpy_recipe, scope)
    exec(torch_recipe, scope)

    want = torch.cat([s["aux_hidden_states"] for s in make_samples()]).to(torch.bfloat16)
    assert torch.equal(bits(scope["t"]), bits(want))
    np.testing.assert_array_equal(scope["x"], want.float().numpy())


@pytest.mark.parametrize("hidden_dtype", ["bfloat16", "float16", "float32"])
def test_numpy_inputs_cast_like_torch(tmp_path: Path, hidden_dtype: str):
    samples = make_samples(n=2)
    as_numpy = [
        {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
        for s in samples
    ]
    a = write_shard(tmp_path / "torch.h5", samples, hidden_dtype)
    b = write_shard(tmp_path / "numpy.h5", as_numpy, hidden_dtype)
    with open_shard(a) as sa, open_shard(b) as sb:
        for name in ("aux_hidden_states", "last_hidden_states"):
            ta = getattr(sa, name)(as_torch=True)
            tb = getattr(sb, name)(as_torch=True)
            assert torch.equal(bits(ta), bits(tb))


def test_numpy_bf16_rounding_matches_torch_on_edge_cases():
    specials = np.array(
        [
            0.0,
            -0.0,
            1.0,
            1.00390625,  # exactly halfway between two bf16 values: ties to even (down)
            1.01171875,  # halfway: ties to even (up)
            3.4e38,  # rounds past bf16 max: becomes inf, as in torch
            -3.4e38,
            1e-40,  # float32 subnormal
            np.inf,
            -np.inf,
            np.nan,
        ],
        dtype=np.float32,
    )
    rng = np.random.default_rng(0)
    values = np.concatenate([specials, rng.standard_normal(10_000).astype(np.float32) * 1e3])
    ours = encoding.float32_to_bf16_bits(values)
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    # NaN payloads differ between torch kernels; only NaN-ness matters (the writer rejects NaN).
    nan = np.isnan(values)
    np.testing.assert_array_equal(ours[~nan], theirs[~nan])
    assert np.isnan(encoding.bf16_bits_to_float32(ours[nan])).all()


def test_compression_round_trip(tmp_path: Path):
    samples = make_samples()
    path = write_shard(tmp_path / "s.h5", samples, "float16", compression="gzip")
    assert validate_shard(path).ok
    with h5py.File(path, "r") as f:
        assert f["aux_hidden_states"].compression == "gzip"
        assert f["aux_hidden_states"].maxshape == (None, 3 * H)
    with open_shard(path) as shard:
        np.testing.assert_array_equal(
            shard.last_hidden_states(slice(0, 5)),
            samples[0]["last_hidden_states"].to(torch.float16).numpy(),
        )


def test_empty_shard_is_valid(tmp_path: Path):
    path = write_shard(tmp_path / "empty.h5", [])
    check = validate_shard(path, expected_ids=[])
    assert check.ok, check.errors
    assert (check.num_samples, check.num_tokens) == (0, 0)
    with open_shard(path) as shard:
        assert shard.sample_ids == []
        assert shard.aux_hidden_states().shape == (0, 3 * H)


# --------------------------------------------------------------------------- attributes


def test_attrs_round_trip(tmp_path: Path):
    aux = resolve_aux_layers("auto", 61)
    attrs = {
        "model": "moonshotai/Kimi-K2.5",
        "tokenizer_hash": "ab" * 32,
        "chat_template_hash": "cd" * 32,
        "final_state": "post_norm",
        "max_seq_len": 4096,
        "temperature": 0.6,
        "thinking": True,
        "dataset": {"name": "ultrachat", "split": "train", "limit": None},
        "datasets": ["a", "b"],
        "excluded": [],
        "matrix": [[1, 2], [3, 4]],
        "source": tmp_path / "prompts.jsonl",
        **aux.as_attrs(),
    }
    with ShardWriter(tmp_path / "s.h5", hidden_size=H, hidden_dtype="float32", attrs=attrs) as w:
        w.add(**make_samples(1)[0])

    with open_shard(tmp_path / "s.h5") as shard:
        got = shard.attrs
    expected = {**attrs, "source": str(tmp_path / "prompts.jsonl")}
    expected |= {
        "format": FORMAT_NAME,
        "format_version": 1,  # version 2 only for float8 storage (test_fp8_storage.py)
        "hidden_dtype": "float32",
        "storage_dtype": "float32",
        "hidden_encoding": "native",
        "hidden_size": H,
        "compression": "none",
        "num_samples": 1,
        "num_tokens": 5,
    }
    assert got == expected
    assert got["aux_layer_ids"] == [1, 29, 57]
    assert got["aux_hidden_states_indices"] == [2, 30, 58]

    # Raw HDF5 view: lists are arrays, dicts are JSON strings (readable without this module).
    with h5py.File(tmp_path / "s.h5", "r") as f:
        assert isinstance(f.attrs["aux_layer_ids"], np.ndarray)
        assert f.attrs["dataset"] == '{"limit": null, "name": "ultrachat", "split": "train"}'


@pytest.mark.parametrize(
    "key",
    [
        "format",
        "hidden_dtype",
        "storage_dtype",
        "scale_block_size",
        "num_samples",
        "json_attrs",
        "compression",
    ],
)
def test_reserved_attrs_are_refused(tmp_path: Path, key: str):
    with pytest.raises(ValueError, match="written by the shard module"):
        ShardWriter(tmp_path / "s.h5", hidden_size=H, hidden_dtype="float32", attrs={key: 1})


@pytest.mark.parametrize("value", [None, object(), [1, "a"], [None], {"x": object()}])
def test_unstorable_attrs_fail_before_any_file_exists(tmp_path: Path, value):
    with pytest.raises(TypeError, match="attr 'bad'"):
        ShardWriter(tmp_path / "s.h5", hidden_size=H, hidden_dtype="float32", attrs={"bad": value})
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hidden_size": 0}, "hidden_size"),
        ({"hidden_dtype": "bf16"}, "hidden_dtype"),
        ({"compression": "zstd"}, "compression"),
    ],
)
def test_writer_arguments_are_checked(tmp_path: Path, kwargs, match):
    args = {"hidden_size": H, "hidden_dtype": "float32", "attrs": {}} | kwargs
    with pytest.raises(ValueError, match=match):
        ShardWriter(tmp_path / "s.h5", **args)


# --------------------------------------------------------------------------- atomicity


def test_exception_inside_with_leaves_nothing(tmp_path: Path):
    samples = make_samples()
    writer = ShardWriter(tmp_path / "s.h5", hidden_size=H, hidden_dtype="bfloat16", attrs={})
    with pytest.raises(RuntimeError, match="boom"), writer as w:
        w.add(**samples[0])
        temps = [p for p in tmp_path.iterdir() if p.name.startswith(".s.h5.")]
        assert len(temps) == 1 and temps[0].name.endswith(".tmp")
        assert not (tmp_path / "s.h5").exists()
        raise RuntimeError("boom")
    assert leftovers(tmp_path) == []


def test_failed_rewrite_keeps_the_previous_shard(shard_path: Path):
    before = file_sha256(shard_path)
    writer = ShardWriter(shard_path, hidden_size=H, hidden_dtype="bfloat16", attrs={})
    with pytest.raises(ShardFormatError), writer as w:
        w.add(**make_samples(seed=1)[0])
        w.add("bad", [1, 2], [1, 1], np.zeros((2, 3 * H)), np.zeros((3, H)))
    assert file_sha256(shard_path) == before
    assert leftovers(shard_path.parent) == [shard_path.name]
    assert validate_shard(shard_path).ok


def test_failure_while_finishing_leaves_nothing(tmp_path: Path, monkeypatch):
    def broken(self, f):
        raise OSError("disk full")

    monkeypatch.setattr(ShardWriter, "_write_index", broken)
    writer = ShardWriter(tmp_path / "s.h5", hidden_size=H, hidden_dtype="float32", attrs={})
    with pytest.raises(OSError, match="disk full"), writer as w:
        w.add(**make_samples(1)[0])
    assert leftovers(tmp_path) == []


def test_successful_rewrite_replaces_the_shard(shard_path: Path):
    write_shard(shard_path, make_samples(n=1, seed=7))
    with open_shard(shard_path) as shard:
        assert shard.sample_ids == ["conv-0"]
    assert leftovers(shard_path.parent) == [shard_path.name]


def test_writer_is_single_use_and_needs_with(tmp_path: Path):
    w = ShardWriter(tmp_path / "s.h5", hidden_size=H, hidden_dtype="float32", attrs={})
    with pytest.raises(RuntimeError, match="inside its `with` block"):
        w.add(**make_samples(1)[0])
    with w:
        w.add(**make_samples(1)[0])
    with pytest.raises(RuntimeError, match="only be used once"), w:
        pass


# --------------------------------------------------------------------------- add() checks


def _sample(t: int = 4, **overrides):
    s = {
        "sample_id": "x",
        "input_ids": np.arange(t),
        "loss_mask": np.ones(t, dtype=np.uint8),
        "aux_hidden_states": np.zeros((t, 3 * H), dtype=np.float32),
        "last_hidden_states": np.zeros((t, H), dtype=np.float32),
    }
    return s | overrides


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"aux_hidden_states": np.zeros((4, H))}, r"'x': aux_hidden_states has shape \(4, 16\)"),
        ({"last_hidden_states": np.zeros((3, H))}, r"'x': last_hidden_states has shape \(3, 16\)"),
        ({"loss_mask": np.ones(3)}, r"'x': loss_mask has shape"),
        ({"loss_mask": np.array([0, 1, 2, 1])}, r"'x': loss_mask must hold only 0 and 1"),
        ({"loss_mask": np.array([0, 1, -1, 1])}, r"'x': loss_mask must hold only 0 and 1"),
        ({"loss_mask": np.ones(4)}, r"'x': loss_mask must be bool or integer 0/1, got float64"),
        ({"loss_mask": np.zeros(4, dtype=np.uint8)}, r"'x': loss_mask has no loss tokens"),
        ({"input_ids": np.arange(4) - 1}, r"'x': input_ids must be in"),
        ({"input_ids": np.arange(4.0)}, r"'x': input_ids must be integers"),
        ({"input_ids": np.zeros((4, 1), dtype=int)}, r"'x': input_ids must have shape \[T\]"),
        ({"aux_hidden_states": np.zeros((4, 3 * H), dtype=int)}, "must be floating point"),
        ({"sample_id": ""}, "non-empty string"),
    ],
)
def test_add_rejects_malformed_samples(tmp_path: Path, overrides, match):
    with ShardWriter(tmp_path / "s.h5", hidden_size=H, hidden_dtype="float32", attrs={}) as w:
        with pytest.raises(ShardFormatError, match=match):
            w.add(**_sample(**overrides))
        assert w.num_samples == 0


def test_add_rejects_empty_sample(tmp_path: Path):
    writer = ShardWriter(tmp_path / "s.h5", hidden_size=H, hidden_dtype="float32", attrs={})
    match = r"'x': input_ids must have shape \[T\] with T > 0"
    with writer as w, pytest.raises(ShardFormatError, match=match):
        w.add(**_sample(t=0))


def test_add_rejects_duplicate_ids(tmp_path: Path):
    with ShardWriter(tmp_path / "s.h5", hidden_size=H, hidden_dtype="float32", attrs={}) as w:
        w.add(**_sample())
        with pytest.raises(ShardFormatError, match="'x': duplicate sample id"):
            w.add(**_sample())
        assert (w.num_samples, w.num_tokens) == (1, 4)


@pytest.mark.parametrize("hidden_dtype", ["bfloat16", "float16", "float32"])
def test_add_rejects_non_finite_values(tmp_path: Path, hidden_dtype: str):
    aux = torch.zeros(4, 3 * H)
    aux[2, 5] = float("nan")
    writer = ShardWriter(tmp_path / "s.h5", hidden_size=H, hidden_dtype=hidden_dtype, attrs={})
    match = "'x': aux_hidden_states has non-finite values"
    with writer as w, pytest.raises(ShardFormatError, match=match):
        w.add(**_sample(aux_hidden_states=aux))


def test_add_rejects_float16_overflow(tmp_path: Path):
    # Finite in float32 but inf once stored as float16: caught after the cast.
    last = torch.full((4, H), 1e5)
    writer = ShardWriter(tmp_path / "s.h5", hidden_size=H, hidden_dtype="float16", attrs={})
    match = r"last_hidden_states has non-finite.*float16"
    with writer as w, pytest.raises(ShardFormatError, match=match):
        w.add(**_sample(last_hidden_states=last))


# --------------------------------------------------------------------------- validation


def test_valid_shard_passes(shard_path: Path):
    check = validate_shard(shard_path, expected_ids=["conv-0", "conv-1", "conv-2"], hidden_size=H)
    assert check.ok, check.errors
    assert check.errors == ()
    assert (check.num_samples, check.num_tokens) == (3, 24)
    assert check.path == str(shard_path)


def test_sha256_is_the_file_hash(shard_path: Path):
    want = hashlib.sha256(shard_path.read_bytes()).hexdigest()
    assert file_sha256(shard_path) == want
    assert validate_shard(shard_path).sha256 == want


def test_truncated_file(shard_path: Path, tmp_path: Path):
    broken = tmp_path / "truncated.h5"
    shutil.copyfile(shard_path, broken)
    with open(broken, "r+b") as fh:
        fh.truncate(broken.stat().st_size // 2)
    check = validate_shard(broken)
    assert not check.ok
    assert check.sha256 == hashlib.sha256(broken.read_bytes()).hexdigest()
    assert len(check.errors) == 1 and "\n" not in check.errors[0]


def test_not_hdf5_and_missing_file(tmp_path: Path):
    junk = tmp_path / "junk.h5"
    junk.write_text("not a shard\n")
    check = validate_shard(junk)
    assert not check.ok and check.errors[0].startswith("cannot open as HDF5")

    check = validate_shard(tmp_path / "missing.h5")
    assert not check.ok and check.sha256 == "" and "cannot read file" in check.errors[0]


def test_not_a_shard(tmp_path: Path):
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros(3)
    check = validate_shard(path)
    assert any("attr format=None" in e for e in check.errors)
    assert any("missing datasets" in e for e in check.errors)
    with pytest.raises(ShardFormatError, match="not a readable shard"):
        open_shard(path)


@pytest.mark.parametrize(("hidden_dtype", "bad"), [("bfloat16", 0x7FC0), ("float32", np.inf)])
@pytest.mark.parametrize("name", ["aux_hidden_states", "last_hidden_states"])
def test_non_finite_values(tmp_path: Path, hidden_dtype: str, bad, name: str):
    path = write_shard(tmp_path / "s.h5", make_samples(), hidden_dtype)
    with h5py.File(path, "r+") as f:
        f[name][7, 3] = bad  # row 7 belongs to conv-1 (rows 5..12)
    check = validate_shard(path)
    assert check.errors == (f"{name}: sample 'conv-1' has non-finite values",)


def test_finite_scan_reads_in_bounded_chunks(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(shard_validation, "_SCAN_BYTES", 1)  # force one row per read
    path = write_shard(tmp_path / "s.h5", make_samples(), "float16")
    with h5py.File(path, "r+") as f:
        f["last_hidden_states"][23, 0] = np.nan
    check = validate_shard(path)
    assert check.errors == ("last_hidden_states: sample 'conv-2' has non-finite values",)


@pytest.mark.parametrize(
    ("offsets", "match"),
    [
        ([1, 5, 13, 24], "sample_offsets: starts at 1"),
        ([0, 13, 5, 24], "sample_offsets: not strictly increasing at index 1"),
        ([0, 5, 5, 24], "sample_offsets: not strictly increasing at index 1"),
        ([0, 5, 13, 20], "sample_offsets: ends at 20"),
    ],
)
def test_bad_offsets(shard_path: Path, offsets, match):
    with h5py.File(shard_path, "r+") as f:
        f["sample_offsets"][:] = offsets
    check = validate_shard(shard_path)
    assert not check.ok
    assert any(e.startswith(match) for e in check.errors), check.errors


def test_offsets_of_the_wrong_length(shard_path: Path):
    with h5py.File(shard_path, "r+") as f:
        del f["sample_offsets"]
        f["sample_offsets"] = np.array([0, 24], dtype=np.int64)
    check = validate_shard(shard_path)
    assert "sample_offsets: shape (2,), expected (4,)" in check.errors


def test_sample_without_loss_tokens(shard_path: Path):
    with h5py.File(shard_path, "r+") as f:
        f["loss_mask"][5:13] = 0
    check = validate_shard(shard_path)
    assert check.errors == ("loss_mask: sample 'conv-1' has no loss tokens",)


def test_expected_ids_mismatch(shard_path: Path):
    check = validate_shard(shard_path, expected_ids=["conv-0", "conv-2", "conv-1"])
    assert check.errors == (
        "sample_ids: do not match expected ids "
        "(first difference at index 1: expected 'conv-2', found 'conv-1')",
    )
    check = validate_shard(shard_path, expected_ids=["conv-0", "conv-1"])
    assert check.errors == ("sample_ids: do not match expected ids (expected 2 ids, found 3)",)


def test_duplicate_ids(shard_path: Path):
    with h5py.File(shard_path, "r+") as f:
        del f["sample_ids"]
        f.create_dataset(
            "sample_ids", data=["conv-0", "conv-1", "conv-0"], dtype=h5py.string_dtype()
        )
    check = validate_shard(shard_path)
    assert check.errors == ("sample_ids: duplicate id 'conv-0'",)


def test_hidden_size_mismatch(shard_path: Path):
    check = validate_shard(shard_path, hidden_size=4096)
    assert check.errors == ("attr hidden_size: expected 4096, found 16",)


def test_wrong_format_version(shard_path: Path):
    future = FORMAT_VERSION + 1
    with h5py.File(shard_path, "r+") as f:
        f.attrs["format_version"] = future
    check = validate_shard(shard_path)
    assert check.errors == (f"attr format_version={future}, this reader understands 1, 2",)
    with pytest.raises(ShardFormatError, match=f"format_version={future}"):
        open_shard(shard_path)


def test_wrong_dataset_dtype(shard_path: Path):
    with h5py.File(shard_path, "r+") as f:
        data = f["input_ids"][()]
        del f["input_ids"]
        f["input_ids"] = data.astype(np.int64)
    check = validate_shard(shard_path)
    assert check.errors == ("input_ids: dtype int64, expected int32",)


def test_many_bad_samples_are_summarised(tmp_path: Path):
    samples = make_samples(n=25)
    path = write_shard(tmp_path / "s.h5", samples)
    with h5py.File(path, "r+") as f:
        f["loss_mask"][:] = 0
    check = validate_shard(path)
    assert len(check.errors) == 21
    assert check.errors[-1] == "... 5 more samples without loss tokens not listed"


# --------------------------------------------------------------------------- reader details


def test_sample_indexing_and_close(shard_path: Path):
    shard = open_shard(shard_path)
    assert shard.sample(-1)["id"] == "conv-2"
    with pytest.raises(IndexError):
        shard.sample(3)
    shard.close()
    shard.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        shard.aux_hidden_states()


def test_bytes_per_token():
    assert bytes_per_token(4096, "bfloat16") == 4 * 4096 * 2 + 4 + 1
    assert bytes_per_token(7168, "float16") == 4 * 7168 * 2 + 5
    assert bytes_per_token(576, "float32") == 4 * 576 * 4 + 5
    with pytest.raises(ValueError, match="hidden_dtype"):
        bytes_per_token(4096, "int8")


def test_bytes_per_token_matches_the_file(tmp_path: Path):
    # Uncompressed storage should be close to the estimate (small, fixed chunk/metadata overhead).
    hidden = 512
    gen = torch.Generator().manual_seed(0)
    t = 2048
    with ShardWriter(tmp_path / "s.h5", hidden_size=hidden, hidden_dtype="bfloat16", attrs={}) as w:
        for i in range(8):
            w.add(
                f"s{i}",
                torch.arange(t // 8),
                torch.ones(t // 8, dtype=torch.bool),
                torch.randn(t // 8, 3 * hidden, generator=gen),
                torch.randn(t // 8, hidden, generator=gen),
            )
    estimate = bytes_per_token(hidden, "bfloat16") * t
    actual = (tmp_path / "s.h5").stat().st_size
    assert estimate <= actual < estimate + 4 * (1 << 20)


# --------------------------------------------------------------------------- streaming (declared)


def write_declared(path: Path, samples: list[dict], order: list[int], **kw) -> Path:
    with ShardWriter(
        path, hidden_size=H, hidden_dtype=kw.pop("hidden_dtype", "bfloat16"), attrs=ATTRS, **kw
    ) as w:
        w.declare_samples(
            [s["sample_id"] for s in samples],
            [s["input_ids"] for s in samples],
            [s["loss_mask"] for s in samples],
        )
        for i in order:
            w.write_states(i, samples[i]["aux_hidden_states"], samples[i]["last_hidden_states"])
    return path


def shard_contents(path: Path) -> dict:
    with h5py.File(path, "r") as f:
        out = {
            n: f[n][()]
            for n in (
                "input_ids",
                "loss_mask",
                "aux_hidden_states",
                "last_hidden_states",
                "sample_offsets",
            )
        }
        out["sample_ids"] = f["sample_ids"].asstr()[()].tolist()
        out["attrs"] = dict(f.attrs)
    return out


@pytest.mark.parametrize("compression", [None, "none", "lzf", "gzip"])
@pytest.mark.parametrize("hidden_dtype", ["bfloat16", "float32"])
def test_declared_out_of_order_writes_equal_appending(tmp_path: Path, compression, hidden_dtype):
    samples = make_samples(5)
    appended = write_shard(tmp_path / "a.h5", samples, hidden_dtype)
    declared = write_declared(
        tmp_path / "d.h5",
        samples,
        [3, 0, 4, 2, 1],
        compression=compression,
        hidden_dtype=hidden_dtype,
    )
    a, d = shard_contents(appended), shard_contents(declared)
    for name in (
        "input_ids",
        "loss_mask",
        "aux_hidden_states",
        "last_hidden_states",
        "sample_offsets",
        "sample_ids",
    ):
        np.testing.assert_array_equal(a[name], d[name], err_msg=name)
        assert np.asarray(a[name]).dtype == np.asarray(d[name]).dtype
    assert d["attrs"]["compression"] == (compression or "none")
    assert a["attrs"]["compression"] == "none"
    assert {k: v for k, v in a["attrs"].items() if k != "compression"} == {
        k: v for k, v in d["attrs"].items() if k != "compression"
    }
    check = validate_shard(declared, expected_ids=[s["sample_id"] for s in samples], hidden_size=H)
    assert check.ok, check.errors
    with open_shard(declared) as shard:  # readers need not know about compression
        got = shard.sample(3)["last_hidden_states"]
        want = samples[3]["last_hidden_states"].to(TORCH_DTYPES[hidden_dtype]).float().numpy()
        np.testing.assert_array_equal(got, want)


def test_declared_shard_misses_a_sample_leaves_nothing(tmp_path: Path):
    samples = make_samples(3)
    with pytest.raises(
        ShardFormatError, match=r"1 declared sample\(s\) were never written \('conv-1'\)"
    ):
        write_declared(tmp_path / "s.h5", samples, [0, 2])
    assert leftovers(tmp_path) == []


def test_declared_mode_refuses_misuse(tmp_path: Path):
    samples = make_samples(2)
    ids = [s["sample_id"] for s in samples]
    toks = [s["input_ids"] for s in samples]
    masks = [s["loss_mask"] for s in samples]
    s0 = samples[0]
    with ShardWriter(tmp_path / "s.h5", hidden_size=H, hidden_dtype="float32", attrs={}) as w:
        with pytest.raises(RuntimeError, match="needs declare_samples"):
            w.write_states(0, s0["aux_hidden_states"], s0["last_hidden_states"])
        with pytest.raises(ValueError, match="2 sample ids, 1 input_ids"):
            w.declare_samples(ids, toks[:1], masks)
        w.declare_samples(ids, toks, masks)
        with pytest.raises(RuntimeError, match="called once"):
            w.declare_samples(ids, toks, masks)
        with pytest.raises(RuntimeError, match="cannot follow declare_samples"):
            w.add(**s0)
        with pytest.raises(IndexError, match="out of range"):
            w.write_states(2, s0["aux_hidden_states"], s0["last_hidden_states"])
        with pytest.raises(ShardFormatError, match="shape"):  # sample 1 is longer
            w.write_states(1, s0["aux_hidden_states"], s0["last_hidden_states"])
        w.write_states(0, s0["aux_hidden_states"], s0["last_hidden_states"])
        with pytest.raises(ShardFormatError, match="written twice"):
            w.write_states(0, s0["aux_hidden_states"], s0["last_hidden_states"])
        w.write_states(1, samples[1]["aux_hidden_states"], samples[1]["last_hidden_states"])
    assert validate_shard(tmp_path / "s.h5", expected_ids=ids).ok


def test_declared_samples_are_checked_like_added_ones(tmp_path: Path):
    samples = make_samples(2)
    with ShardWriter(tmp_path / "s.h5", hidden_size=H, hidden_dtype="float32", attrs={}) as w:
        with pytest.raises(ShardFormatError, match="duplicate sample id"):
            w.declare_samples(
                ["a", "a"], [s["input_ids"] for s in samples], [s["loss_mask"] for s in samples]
            )
        w.declare_samples([], [], [])  # an empty shard is still a valid one
    check = validate_shard(tmp_path / "s.h5", expected_ids=[])
    assert check.ok, check.errors


def test_declared_uncompressed_shard_is_contiguous_and_near_ideal_size(tmp_path: Path):
    hidden, t, n = 512, 4096, 16
    gen = torch.Generator().manual_seed(0)
    lengths = [t // n] * n
    with ShardWriter(tmp_path / "s.h5", hidden_size=hidden, hidden_dtype="bfloat16", attrs={}) as w:
        w.declare_samples(
            [f"s{i}" for i in range(n)],
            [torch.arange(k) for k in lengths],
            [torch.ones(k, dtype=torch.bool) for k in lengths],
        )
        for i in reversed(range(n)):
            w.write_states(
                i,
                torch.randn(lengths[i], 3 * hidden, generator=gen),
                torch.randn(lengths[i], hidden, generator=gen),
            )
    with h5py.File(tmp_path / "s.h5", "r") as f:
        assert f["aux_hidden_states"].chunks is None
        assert f["aux_hidden_states"].compression is None
    ideal = bytes_per_token(hidden, "bfloat16") * t
    actual = (tmp_path / "s.h5").stat().st_size
    # Only HDF5 metadata on top: no partly filled chunks, no fill pass.
    assert ideal <= actual < ideal + 64 * 1024
