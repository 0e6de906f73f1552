"""speculators export: one training folder that vLLM speculators 0.9.0's own code reads, with
the pre-norm final state its trainer's teacher needs, checked by that code as it is written.

Tiny random targets whose final-norm weight is far from 1 (so handing over the post-norm
state is visibly wrong): Llama, Qwen3 and the Kimi-K2.5-shaped wrapper (DeepSeek-V3 under
``text_config``, ``language_model.*`` weights). Their data is what they generate greedily,
captured by the real extraction code, so the manifest's agreement is high.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from support.target_models import (
    make_kimi_dir,
    make_qwen3_dir,
    randomize_final_norm,
    tiktoken_cache,
    tiny_llama,
)

pytest.importorskip("speculators", reason="the README's test command installs speculators")

from speculators.train.data import ArrowDataset, CollateFn
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

from eagle3data.consumers import speculators as spec
from eagle3data.consumers.speculators_check import (
    FINAL_STATE_TOLERANCE,
    FP8_FINAL_STATE_TOLERANCE,
    verify_speculators_export,
)
from eagle3data.consumers.speculators_format import EXPORT_JSON
from eagle3data.consumers.vocab import draft_vocab
from eagle3data.hidden_states import agreement
from eagle3data.hidden_states.extraction import extract_into_shard
from eagle3data.hidden_states.final_state import load_final_norm
from eagle3data.hidden_states.transformers_capture import HiddenStateExtractor
from eagle3data.loader import HiddenStateDataset
from eagle3data.model_config import hidden_size, read_model_config, rms_norm_eps
from eagle3data.shards import ShardWriter, open_shard
from eagle3data.target import remote_code_files

DATASETS = ("A1", "B2")


def _llama_dir(out: Path) -> Path:
    """The suite's tiny Llama, in float32."""
    from support.chat_tokenizers import smollm2

    tokenizer = smollm2()
    tiny_llama(tokenizer).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


MODELS = {
    "llama": _llama_dir,
    "qwen3": make_qwen3_dir,
    "kimi-wrapper": lambda out: make_kimi_dir(out, wrapper=True),
}


def _write_run(
    base: Path,
    model_dir: Path,
    *,
    draft_size: int = 32,
    storage_dtype: str = "float32",
    final_state: str = "pre_norm",
) -> dict[str, Any]:
    """Greedy data of the model, extracted into shards, a manifest like the validate
    job's (agreement over every produced position), and a draft vocabulary."""
    trust = bool(remote_code_files(model_dir))  # the Kimi fixture's tokenizer
    with tiktoken_cache(""):
        extractor = HiddenStateExtractor(
            str(model_dir),
            dtype="float32",
            device="cpu",
            trust_remote_code=trust,
            final_state=final_state,
        )
    model = extractor.model
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    head = agreement.load_head(model_dir)
    norm = load_final_norm(model_dir, trust_remote_code=trust)
    eot = agreement.end_of_turn_ids(model_dir)
    counts: Counter[int] = Counter()
    shard_dirs = []
    for d, name in enumerate(DATASETS):
        directory = base / "hidden_states" / name
        directory.mkdir(parents=True)
        entries, stats = [], agreement.AgreementStats()
        for k, n in enumerate([3, 2] if d == 0 else [2]):
            ids, masks, sample_ids = [], [], []
            for i in range(n):
                prompt = torch.randint(10, vocab, (1, 5 + i), generator=gen)
                with torch.no_grad():
                    out = model.generate(
                        prompt,
                        attention_mask=torch.ones_like(prompt),
                        do_sample=False,
                        max_new_tokens=12,
                        min_new_tokens=12,
                        pad_token_id=0,
                    )[0]
                ids.append(out.tolist())
                masks.append([0] * prompt.shape[1] + [1] * (len(out) - prompt.shape[1]))
                sample_ids.append(f"{name}-{k}-{i}")
                counts.update(t for t, m in zip(ids[-1], masks[-1], strict=True) if m)
            path = directory / f"shard-{k:05d}.h5"
            attrs = {
                "dataset": name,
                "model": model_dir.name,
                "final_state": final_state,
                "max_seq_len": 64,
                **extractor.aux.as_attrs(),
            }
            with ShardWriter(
                path,
                hidden_size=extractor.hidden_size,
                hidden_dtype="float32",
                attrs=attrs,
                storage_dtype=storage_dtype,  # type: ignore[arg-type]
            ) as w:
                extract_into_shard(extractor, w, sample_ids, ids, masks, batch_tokens=256)
            with open_shard(path) as shard:
                stats = stats.combine(
                    agreement.shard_agreement(shard, head, eot, None, seed=k, final_norm=norm)
                )
                attrs = dict(shard.attrs)
            entries.append({"file": path.name, "samples": n})
        manifest = {
            "dataset": name,
            "shards": entries,
            "attrs": {key: v.tolist() if hasattr(v, "tolist") else v for key, v in attrs.items()},
            "agreement": {**stats.summary(), "settings": {"positions_per_shard": "all"}},
        }
        (directory / "manifest.json").write_text(json.dumps(manifest, default=str))
        shard_dirs.append(directory)
    vocab_file = base / "draft_vocab.pt"
    mapping = draft_vocab(counts, draft_size, vocab)
    torch.save({"d2t": mapping.d2t, "t2d": mapping.t2d}, vocab_file)
    return {
        "model": model_dir,
        "vocab": vocab_file,
        "trust": trust,
        "final_state": final_state,
        "A1": shard_dirs[0],
        "B2": shard_dirs[1],
    }


# Shards hold the pre-norm state (the default); post-norm shards (older ones) are exported
# through the norm's inverse.
RUNS = [(model, "pre_norm") for model in MODELS] + [("llama", "post_norm")]


@pytest.fixture(scope="module", params=RUNS, ids=[f"{m}-{s}" for m, s in RUNS])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    model, final_state = request.param
    base = tmp_path_factory.mktemp(f"spec-{model}-{final_state}")
    model_dir = MODELS[model](base / "model")
    randomize_final_norm(model_dir)
    return _write_run(base, model_dir, final_state=final_state)


def _export(run: dict, out: Path, **kwargs) -> None:
    spec.export_speculators(
        datasets=list(DATASETS),
        shard_dirs=[str(run[d]) for d in DATASETS],
        model_path=str(run["model"]),
        draft_vocab=str(run["vocab"]),
        out_dir=str(out),
        work_dir=str(out.parent / "work"),
        trust_remote_code=run["trust"],
        **kwargs,
    )


def _verify(run: dict, out: Path) -> dict:
    return verify_speculators_export(
        out,
        datasets=list(DATASETS),
        shard_dirs=[str(run[d]) for d in DATASETS],
        model_path=str(run["model"]),
        trust_remote_code=run["trust"],
    )


def _digest(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def test_speculators_reads_the_export_and_its_teacher_agrees(run: dict, tmp_path: Path) -> None:
    out = tmp_path / "speculators"
    _export(run, out)
    info = json.loads((out / EXPORT_JSON).read_text())
    manifests = {d: json.loads((run[d] / "manifest.json").read_text()) for d in DATASETS}
    layer_ids = manifests["A1"]["attrs"]["aux_hidden_states_indices"]
    assert info["target_layer_ids"] == layer_ids
    assert f"--target-layer-ids {' '.join(map(str, layer_ids))}" in info["train_command"]
    for flag in ("--draft-attn-impl sdpa", "--loss-implementation eager"):
        assert flag in info["train_command"]
    # speculators' own dataset and collate, as its trainer builds them.
    data = ArrowDataset(max_len=4096, datapath=str(out), on_missing="raise")
    assert len(data) == info["num_samples"] == 7
    # One folder, the datasets' rows mixed in a seeded order (its val split is by row index).
    order = [r["dataset"] for r in info["rows"]]
    assert sorted(order) == ["A1"] * 5 + ["B2"] * 2 and order != sorted(order)
    h = hidden_size(read_model_config(run["model"]))
    batch = CollateFn(4096, h, num_target_layers=3)([data[i] for i in range(len(data))])
    assert batch["hidden_states"].shape[-1] == 3 * h
    # The teacher as its trainer computes it matches the manifest within the tolerance.
    for d in DATASETS:
        got = info["self_check"]["agreement"][d]
        assert got["manifest_agreement"] == manifests[d]["agreement"]["agreement"] > 0.9
        assert got["shards_agreement_same_positions"] == got["manifest_agreement"]
        assert abs(got["speculators_teacher_agreement"] - got["manifest_agreement"]) <= 0.02
    assert info["self_check"]["final_state_max_rel_error"] < FINAL_STATE_TOLERANCE["bfloat16"]
    # Its vocabulary builder over token_freq.pt gives the d2t/t2d files.
    freq = torch.load(out / "token_freq.pt", weights_only=True)
    d2t, t2d = build_vocab_mappings_from_distribution(freq, 32, len(np.load(out / "t2d-32.npy")))
    assert torch.equal(d2t, torch.from_numpy(np.load(out / "d2t-32.npy")))
    assert torch.equal(t2d, torch.from_numpy(np.load(out / "t2d-32.npy")))
    assert _verify(run, out)["agreement"] == info["self_check"]["agreement"]
    # Pre-norm shards: the exported final state is theirs, rounded once to bf16, no inverse.
    if run["final_state"] == "pre_norm":
        first = info["rows"][0]
        data = HiddenStateDataset(run[first["dataset"]])
        item = next(data[j] for j in range(len(data)) if data[j]["id"] == first["id"])
        states = load_file(out / "hidden_states" / "hs_0.safetensors")["hidden_states"]
        assert torch.equal(states[:, 3], item["last_hidden_states"].to(torch.bfloat16))
        assert info["final_state"] == "pre_norm: the shards' pre-norm state"


def _rewrite_states(out: Path, change) -> None:
    for path in sorted((out / "hidden_states").glob("hs_*.safetensors")):
        tensors = load_file(path)
        tensors["hidden_states"] = change(tensors["hidden_states"], int(path.stem[3:]))
        save_file(tensors, path)


def test_post_norm_state_handed_over_as_is_fails_loudly(run: dict, tmp_path: Path) -> None:
    out = tmp_path / "speculators"
    _export(run, out)
    info = json.loads((out / EXPORT_JSON).read_text())
    posts = {}
    for d in DATASETS:
        data = HiddenStateDataset(
            run[d], final_state="post_norm", model=run["model"], trust_remote_code=run["trust"]
        )
        for j in range(len(data)):
            item = data[j]
            posts[(d, item["id"])] = item["last_hidden_states"]

    def post_as_is(states: torch.Tensor, i: int) -> torch.Tensor:
        row = info["rows"][i]
        states[:, 3] = posts[(row["dataset"], row["id"])].to(states.dtype)
        return states

    _rewrite_states(out, post_as_is)
    with pytest.raises(spec.SpeculatorsExportError, match="final state") as caught:
        _verify(run, out)
    assert "\n" not in str(caught.value)


def test_aux_layers_in_the_wrong_order_fail_loudly(run: dict, tmp_path: Path) -> None:
    out = tmp_path / "speculators"
    _export(run, out)
    _rewrite_states(out, lambda s, i: s[:, [2, 1, 0, 3]].contiguous())
    with pytest.raises(spec.SpeculatorsExportError, match=r"aux layer\(s\) \[0, 2\]"):
        _verify(run, out)


@pytest.mark.parametrize("model", ["llama"])
def test_the_export_is_atomic_and_deterministic(tmp_path: Path, model: str, monkeypatch) -> None:
    model_dir = MODELS[model](tmp_path / "model")
    randomize_final_norm(model_dir)
    run = _write_run(tmp_path / "data", model_dir)
    out = tmp_path / "results" / "speculators"
    seen = []

    def failing_check(*args, **kwargs):
        seen.append(sorted(p.name for p in Path(args[0]).iterdir()))
        assert not out.exists(), "nothing at the target until complete"
        raise spec.SpeculatorsExportError("check failed")

    with monkeypatch.context() as m:
        m.setattr(spec, "verify_speculators_export", failing_check)
        with pytest.raises(spec.SpeculatorsExportError):
            _export(run, out)
    assert "hidden_states" in seen[0] and "token_freq.pt" in seen[0]
    assert not out.exists() and not list((out.parent / "work").iterdir())
    _export(run, out)
    first = _digest(out)
    _export(run, out)
    assert _digest(out) == first
    _export(run, out, seed=1)
    info = json.loads((out / EXPORT_JSON).read_text())
    assert _digest(out)["hidden_states/hs_0.safetensors"] != first["hidden_states/hs_0.safetensors"]
    assert info["seed"] == 1


def _tiny_config_dir(out: Path, config) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


@pytest.mark.parametrize(
    ("kind", "norm_class"), [("gemma", "GemmaRMSNorm"), ("stablelm", "LayerNorm")]
)
def test_a_norm_that_is_not_plain_rms_is_refused_in_one_line(
    tmp_path: Path, kind: str, norm_class: str
) -> None:
    from transformers import GemmaConfig, StableLmConfig

    sizes = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
    }
    config = GemmaConfig(head_dim=16, **sizes) if kind == "gemma" else StableLmConfig(**sizes)
    model_dir = _tiny_config_dir(tmp_path / kind, config)
    randomize_final_norm(model_dir)
    with pytest.raises(spec.SpeculatorsExportError) as caught:
        spec.restorable_final_norm(model_dir)
    message = str(caught.value)
    assert "\n" not in message and f"the final norm is {norm_class}," in message


def test_plain_rms_norms_are_inverted_and_zero_weights_refused(tmp_path: Path) -> None:
    model_dir = _llama_dir(tmp_path / "llama")
    randomize_final_norm(model_dir)
    norm = spec.restorable_final_norm(model_dir)
    weight, eps = norm.weight, norm.eps
    stored = load_file(model_dir / "model.safetensors")["model.norm.weight"]
    assert torch.equal(weight, stored.float())
    assert eps == rms_norm_eps(read_model_config(model_dir))
    # The state the norm maps onto post, also where mean(x^2) is a few epsilons (the tiny
    # models' first tokens; post / w alone was 1% off at 46 epsilons).
    x = torch.randn(5, weight.numel()) * torch.tensor([[10.0], [1.0], [0.1], [7e-3], [1e-4]])
    post = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    pre = norm.prenorm_of(post)
    again = pre * torch.rsqrt(pre.pow(2).mean(-1, keepdim=True) + eps) * weight
    assert torch.allclose(again, post, rtol=1e-5, atol=0)
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.norm.weight"][3] = 0
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(spec.SpeculatorsExportError, match="1 zero weight"):
        spec.restorable_final_norm(model_dir)


def test_float16_export_is_refused(run: dict, tmp_path: Path) -> None:
    with pytest.raises(spec.SpeculatorsExportError, match="bfloat16 or float32"):
        _export(run, tmp_path / "speculators", dtype="float16")


def test_fp8_shards_are_exported_dequantized(tmp_path: Path) -> None:
    model_dir = _llama_dir(tmp_path / "model")
    randomize_final_norm(model_dir)
    run = _write_run(tmp_path / "data", model_dir, storage_dtype="float8_e4m3fn")
    out = tmp_path / "speculators"
    _export(run, out, dtype="float32")
    info = json.loads((out / EXPORT_JSON).read_text())
    check = info["self_check"]
    assert check["final_state_max_rel_error"] < check["final_state_tolerance"]
    assert check["final_state_tolerance"] == FP8_FINAL_STATE_TOLERANCE
    # The aux states are the loader's dequantized values, exactly (float32: no rounding).
    first = info["rows"][0]
    data = HiddenStateDataset(run[first["dataset"]])
    item = next(data[j] for j in range(len(data)) if data[j]["id"] == first["id"])
    states = load_file(out / "hidden_states" / "hs_0.safetensors")["hidden_states"]
    assert states.dtype == torch.float32
    assert torch.equal(states[:, :3].flatten(1), item["aux_hidden_states"].float())
