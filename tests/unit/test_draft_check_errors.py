"""The draft check's refusals: one line each, through the project's errors, before any state
is loaded; and the teacher's norm read as the speculators export reads it.

The stage function is run on shard directories that hold only a manifest: every refusal
here must come before a shard is opened.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.target_models import make_kimi_dir, make_norm_target_dir

from eagle3data.consumers import draft_check as dc
from eagle3data.errors import DraftCheckError, UserError, is_user_error

AUX = [1, 4, 7]


def _manifest_dir(directory: Path, *, samples: int, tokens: int, hidden: int = 64) -> str:
    """A shard directory as the validate job leaves it, without its shards."""
    directory.mkdir(parents=True)
    manifest = {
        "dataset": directory.name,
        "num_samples": samples,
        "num_tokens": tokens,
        "shards": [{"file": "shard-00000.h5", "samples": samples, "tokens": tokens}],
        "attrs": {
            "hidden_size": hidden,
            "aux_hidden_states_indices": AUX,
            "final_state": "pre_norm",
        },
    }
    (directory / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    return str(directory)


def _run(tmp_path: Path, model_dir: Path, settings: dict[str, Any], **kwargs: Any) -> None:
    shard_dirs = kwargs.pop("shard_dirs", None) or [
        _manifest_dir(tmp_path / "shards" / "A", samples=8, tokens=400)
    ]
    dc.draft_check(
        shard_dirs=shard_dirs,
        draft_vocab=str(tmp_path / "no-vocab.pt"),
        model_dir=str(model_dir),
        out=str(tmp_path / "summary.json"),
        settings=settings,
        **kwargs,
    )


def _one_line(exc: BaseException) -> str:
    message = str(exc)
    assert is_user_error(exc) and "\n" not in message, message
    return message


@pytest.fixture(scope="module")
def rms_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_norm_target_dir(tmp_path_factory.mktemp("rms"), "rms")


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_norm_target_dir(tmp_path_factory.mktemp("gemma"), "gemma")


def test_bad_settings_are_one_line(tmp_path: Path, rms_dir: Path) -> None:
    with pytest.raises(DraftCheckError) as caught:
        _run(tmp_path, rms_dir, {"epochs": 0})
    assert "draft_check.epochs" in _one_line(caught.value)


def test_a_missing_speculators_says_how_to_install_it(
    tmp_path: Path, rms_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # None in sys.modules makes an import fail; submodules an earlier test imported too.
    for name in [n for n in sys.modules if n == "speculators" or n.startswith("speculators.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "speculators", None)
    with pytest.raises(DraftCheckError) as caught:
        _run(tmp_path, rms_dir, {})
    message = _one_line(caught.value)
    assert "pip install" in message and "speculators==0.9.0" in message


def test_a_run_over_the_memory_bound_is_refused_before_loading(
    tmp_path: Path, rms_dir: Path
) -> None:
    pytest.importorskip("speculators")
    big = _manifest_dir(tmp_path / "shards" / "big", samples=1000, tokens=10_000_000)
    with pytest.raises(DraftCheckError) as caught:
        _run(tmp_path, rms_dir, {"memory_limit_gb": 2}, shard_dirs=[big])
    message = _one_line(caught.value)
    # 1e7 tokens x 4 states x 64 x 4 bytes x 4 copies = 41.0 GB
    need = dc.memory_needed([big])
    assert need == 10_000_000 * 4 * 64 * 4 * dc.RESIDENT_COPIES
    assert "draft_check.memory_limit_gb" in message and "2 GB" in message
    assert f"{need / 1e9:.1f} GB" in message


def test_too_few_conversations_and_differing_layers_are_one_line(
    tmp_path: Path, rms_dir: Path
) -> None:
    pytest.importorskip("speculators")
    one = _manifest_dir(tmp_path / "shards" / "one", samples=1, tokens=40)
    with pytest.raises(DraftCheckError, match="at least 2 samples") as caught:
        _run(tmp_path, rms_dir, {}, shard_dirs=[one])
    _one_line(caught.value)
    other = _manifest_dir(tmp_path / "shards" / "other", samples=5, tokens=40)
    manifest = json.loads((Path(other) / "manifest.json").read_text())
    manifest["attrs"]["aux_hidden_states_indices"] = [2, 4, 7]
    (Path(other) / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DraftCheckError, match="aux layers") as caught:
        _run(tmp_path, rms_dir, {}, shard_dirs=[one, other])
    _one_line(caught.value)


def test_a_gemma_norm_target_is_refused_in_one_line(tmp_path: Path, gemma_dir: Path) -> None:
    """Gemma's ``x * (1 + w)``: speculators' teacher (``x * w``) is wrong for it."""
    pytest.importorskip("speculators")
    with pytest.raises(DraftCheckError) as caught:
        _run(tmp_path, gemma_dir, {})
    assert "the final norm is GemmaRMSNorm," in _one_line(caught.value)
    # The library function refuses too, before it trains anything.
    n = 12
    sample = dc.Sample(
        "s",
        torch.arange(n),
        torch.ones(n, dtype=torch.long),
        torch.randn(n, 3 * 64),
        torch.randn(n, 64),
    )
    vocab = {"d2t": torch.zeros(8, dtype=torch.long), "t2d": torch.zeros(10, dtype=torch.bool)}
    settings = dc.DraftCheckSettings(seeds=(0,), epochs=1)
    with pytest.raises(DraftCheckError, match="GemmaRMSNorm"):
        dc.run_draft_check([sample, sample], gemma_dir, vocab, AUX, settings)


def test_the_plain_rms_target_reads_its_norm_weight(rms_dir: Path) -> None:
    weight = dc.verifier_norm(rms_dir).weight
    stored = load_file(rms_dir / "model.safetensors")["model.norm.weight"]
    assert torch.equal(weight, stored.float())


def test_a_wrapper_target_reads_its_text_decoders_norm(tmp_path: Path) -> None:
    """Kimi-K2.5's layout (``language_model.model.norm.weight``) next to a vision tower whose
    own ``model.norm.weight`` has a shorter name: the decoder's norm is read, by the layout."""
    model_dir = make_kimi_dir(tmp_path / "kimi", wrapper=True)
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    decoder = tensors["language_model.model.norm.weight"]
    tensors["language_model.model.norm.weight"] = torch.linspace(0.5, 2.0, decoder.numel()).to(
        decoder.dtype
    )
    tensors["vision_tower.model.norm.weight"] = torch.full((16,), 7.0, dtype=decoder.dtype)
    save_file(tensors, path, metadata={"format": "pt"})
    weight = dc.verifier_norm(model_dir, trust_remote_code=True).weight
    assert torch.equal(weight, tensors["language_model.model.norm.weight"].float())


def test_a_remote_code_target_needs_trust(tmp_path: Path) -> None:
    """Kimi's tokenizer is remote code: without trust_remote_code the draft check stops in one
    line naming the key; with it, the draft is shaped from the text decoder."""
    pytest.importorskip("speculators")
    model_dir = make_kimi_dir(tmp_path / "kimi", wrapper=True)
    vocab = {"d2t": torch.zeros(8, dtype=torch.long), "t2d": torch.zeros(10, dtype=torch.bool)}
    with pytest.raises(UserError) as caught:
        dc.build_draft(model_dir, vocab, AUX, num_layers=1, ttt_steps=1, seed=0)
    assert "model.trust_remote_code" in _one_line(caught.value)
    # Trusted, its text decoder (DeepSeek-V3) is read: speculators has no DeepSeek draft
    # layers, so the draft has its trainer's default llama layers shaped from that decoder.
    vocab["t2d"] = torch.zeros(163_840, dtype=torch.bool)  # the target's vocabulary
    vocab["t2d"][:8] = True
    draft = dc.build_draft(
        model_dir, vocab, AUX, num_layers=1, ttt_steps=1, seed=0, trust_remote_code=True
    )
    layers = draft.config.transformer_layer_config
    decoder = json.loads((model_dir / "config.json").read_text())["text_config"]
    assert (layers.model_type, layers.hidden_size) == ("llama", decoder["hidden_size"])


def test_a_small_check_runs_from_real_shards_within_its_bound(
    tmp_path: Path, rms_dir: Path
) -> None:
    """The stage function end to end on shards the extraction writes (post-norm, so the
    final state goes through the norm weight the check read), under a bound it fits."""
    pytest.importorskip("speculators")
    import numpy as np

    from eagle3data.consumers.vocab import draft_vocab
    from eagle3data.hidden_states.extraction import extract_into_shard
    from eagle3data.hidden_states.final_state import POST_NORM
    from eagle3data.hidden_states.transformers_capture import HiddenStateExtractor
    from eagle3data.shards import ShardWriter, open_shard

    extractor = HiddenStateExtractor(
        str(rms_dir), dtype="float32", device="cpu", final_state=POST_NORM
    )
    vocab_size = extractor.model.config.vocab_size
    rng = np.random.default_rng(0)
    tokens = [rng.integers(3, 200, size=n).tolist() for n in (20, 26, 18, 30, 24, 22, 28, 16)]
    masks = [[0] * 6 + [1] * (len(t) - 6) for t in tokens]
    ids = [f"c{i}" for i in range(len(tokens))]
    directory = tmp_path / "shards" / "A1"
    directory.mkdir(parents=True)
    path = directory / "shard-00000.h5"
    attrs = {"dataset": "A1", "final_state": POST_NORM, **extractor.aux.as_attrs()}
    with ShardWriter(
        path, hidden_size=extractor.hidden_size, hidden_dtype="float32", attrs=attrs
    ) as w:
        extract_into_shard(extractor, w, ids, tokens, masks, batch_tokens=64)
    with open_shard(path) as shard:
        stored = {k: v.tolist() if hasattr(v, "tolist") else v for k, v in shard.attrs.items()}
    n_tokens = sum(len(t) for t in tokens)
    manifest = {
        "dataset": "A1",
        "num_samples": len(ids),
        "num_tokens": n_tokens,
        "shards": [{"file": path.name, "samples": len(ids), "tokens": n_tokens}],
        "attrs": stored,
    }
    (directory / "manifest.json").write_text(json.dumps(manifest, default=str))
    counts: dict[int, int] = {}
    for t, m in zip(tokens, masks, strict=True):
        for token, supervised in zip(t, m, strict=True):
            counts[token] = counts.get(token, 0) + supervised
    vocab = draft_vocab(counts, 32, vocab_size)
    torch.save({"d2t": vocab.d2t, "t2d": vocab.t2d}, tmp_path / "vocab.pt")
    out = tmp_path / "summary.json"
    dc.draft_check(
        shard_dirs=[str(directory)],
        draft_vocab=str(tmp_path / "vocab.pt"),
        model_dir=str(rms_dir),
        out=str(out),
        settings={"seeds": [0, 1], "epochs": 1, "ttt_steps": 2, "memory_limit_gb": 0.01},
    )
    summary = json.loads(out.read_text())
    assert {r["variant"] for r in summary["runs"]} >= {"trained", "untrained"}
    assert summary["conversations"]["train"] + summary["conversations"]["heldout"] == len(ids)
