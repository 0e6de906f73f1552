"""Loading the target: remote code only when trusted, a wrapper's text decoder, no random layers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.target_models import kimi_text_decoder, make_kimi_dir, tiktoken_cache

from eagle3data.errors import ModelConfigError
from eagle3data.target import (
    check_remote_code,
    load_causal_lm,
    load_tokenizer,
    remote_code_files,
)


@pytest.fixture(scope="module")
def wrapper_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_kimi_dir(tmp_path_factory.mktemp("kimi") / "wrapper", wrapper=True)


@pytest.fixture(autouse=True)
def _fresh_tiktoken_cache(tmp_path: Path):
    with tiktoken_cache(str(tmp_path / "tiktoken")):
        yield


def test_declared_custom_code_needs_trust_and_the_error_names_the_key(
    tmp_path: Path, wrapper_dir: Path
) -> None:
    assert remote_code_files(wrapper_dir) == ["tokenizer_config.json auto_map.AutoTokenizer"]
    with pytest.raises(ModelConfigError, match=r"Set model\.trust_remote_code: true") as err:
        load_tokenizer(wrapper_dir, trust_remote_code=False)
    assert "\n" not in str(err.value)
    check_remote_code(wrapper_dir, True)
    # A config.json that maps its own classes counts as custom code too.
    (tmp_path / "config.json").write_text(json.dumps({"auto_map": {"AutoConfig": "x.Y"}}))
    with pytest.raises(ModelConfigError, match=r"config\.json auto_map\.AutoConfig"):
        check_remote_code(tmp_path, False)


def test_no_fallback_to_a_converted_tokenizer(wrapper_dir: Path) -> None:
    tokenizer = load_tokenizer(wrapper_dir, trust_remote_code=True)
    assert type(tokenizer).__name__ == "TikTokenTokenizer"
    assert not tokenizer.is_fast


def test_a_wrapper_loads_its_text_decoder(wrapper_dir: Path) -> None:
    model, _ = load_causal_lm(wrapper_dir, dtype="float32", device="cpu", trust_remote_code=True)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert model.config.hidden_size == 64
    reference = kimi_text_decoder(wrapper_dir).float()
    ids = torch.tensor([[163584, 1000, 2000, 3000, 163586]])
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits)


def test_a_decoder_weight_missing_from_the_checkpoint_is_an_error(
    tmp_path: Path, wrapper_dir: Path
) -> None:
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in wrapper_dir.iterdir():
        if f.name != "model.safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(wrapper_dir / "model.safetensors")
    dropped = "language_model.model.layers.3.self_attn.o_proj.weight"
    del tensors[dropped]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelConfigError, match=r"layers\.3\.self_attn\.o_proj\.weight"):
        load_causal_lm(broken, dtype="float32", device="cpu", trust_remote_code=True)
