"""One reader of the target's config.json: the text decoder's sizes, whether the config
is flat (Llama), a multimodal wrapper with a nested text_config (Kimi-K2.5, LLaVA), a
transformers config object or a namespace; a conflict between the levels is an error."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import LlamaConfig, LlavaConfig, PretrainedConfig

from eagle3data.errors import ModelConfigError, UserError
from eagle3data.model_config import (
    architectures,
    context_length,
    declared_dtype,
    decoder_key_mapping,
    decoder_tensor_name,
    hidden_size,
    is_wrapper,
    num_hidden_layers,
    rms_norm_eps,
    text_decoder_dict,
    vocab_size,
)

# Kimi-K2.5's shape: the wrapper declares no sizes of its own.
KIMI_LIKE = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "dtype": "bfloat16",
    "text_config": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "vocab_size": 163840,
        "max_position_embeddings": 262144,
    },
}


def test_a_wrapper_is_read_through_its_text_config() -> None:
    assert hidden_size(KIMI_LIKE) == 7168
    assert num_hidden_layers(KIMI_LIKE) == 61
    assert vocab_size(KIMI_LIKE) == 163840
    assert context_length(KIMI_LIKE) == 262144
    assert architectures(KIMI_LIKE) == ["KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM"]
    assert declared_dtype(KIMI_LIKE) == "bfloat16"


def test_a_flat_config() -> None:
    llama = LlamaConfig(hidden_size=64, num_hidden_layers=8, vocab_size=100)
    assert (hidden_size(llama), num_hidden_layers(llama), vocab_size(llama)) == (64, 8, 100)
    assert context_length(llama) == llama.max_position_embeddings
    assert architectures({"hidden_size": 8}) == []
    assert context_length({"hidden_size": 8}) is None


@pytest.mark.parametrize("key", ["hidden_size", "num_hidden_layers", "vocab_size"])
def test_levels_that_disagree_are_an_error(key: str) -> None:
    read = {"hidden_size": hidden_size, "num_hidden_layers": num_hidden_layers}.get(key, vocab_size)
    config = {key: 27, "text_config": {key: 61}}
    with pytest.raises(ModelConfigError, match=f"{key}=27 but text_config.{key}=61"):
        read(config)
    assert read({key: 61, "text_config": {key: 61}}) == 61  # agreeing levels are fine


def test_context_of_a_wrapper_is_not_silently_unknown() -> None:
    # The top level of a wrapper declares no max_position_embeddings: the decoder's counts.
    assert context_length({"text_config": {"max_position_embeddings": 4096}}) == 4096


def test_missing_values_are_user_errors() -> None:
    with pytest.raises(ModelConfigError, match=r"no vocab_size \(nor text_config.vocab_size\)"):
        vocab_size({})
    with pytest.raises(UserError, match="hidden_size must be a positive integer"):
        hidden_size({"hidden_size": 0})


def test_num_hidden_layers_plain_config() -> None:
    assert num_hidden_layers(LlamaConfig(num_hidden_layers=30)) == 30
    assert num_hidden_layers(SimpleNamespace(num_hidden_layers=32)) == 32
    assert num_hidden_layers({"num_hidden_layers": 36}) == 36


def test_num_hidden_layers_vlm_wrapper() -> None:
    # Kimi-K2.5 style: the wrapper has no depth of its own, the language model's is in text_config.
    kimi_like = SimpleNamespace(text_config=SimpleNamespace(num_hidden_layers=61))
    assert num_hidden_layers(kimi_like) == 61
    assert num_hidden_layers({"text_config": {"num_hidden_layers": 61}}) == 61
    llava = LlavaConfig(text_config=LlamaConfig(num_hidden_layers=24).to_dict())
    assert num_hidden_layers(llava) == 24


def test_num_hidden_layers_missing() -> None:
    with pytest.raises(ValueError, match="no num_hidden_layers"):
        num_hidden_layers(PretrainedConfig())


def test_declared_dtype_reads_either_key_and_vlm_wrappers() -> None:
    assert declared_dtype({"dtype": "bfloat16"}) == "bfloat16"
    assert declared_dtype({"torch_dtype": "float16"}) == "float16"
    assert declared_dtype({"text_config": {"torch_dtype": "bfloat16"}}) == "bfloat16"
    assert declared_dtype({}) == "float32"
    assert declared_dtype(LlamaConfig(dtype="bfloat16")) == "bfloat16"


def test_a_wrapper_is_a_config_with_a_text_config() -> None:
    assert is_wrapper(KIMI_LIKE)
    assert is_wrapper(LlavaConfig(text_config=LlamaConfig(num_hidden_layers=24).to_dict()))
    assert is_wrapper(SimpleNamespace(text_config=SimpleNamespace(hidden_size=8)))
    assert not is_wrapper({"hidden_size": 8})
    assert not is_wrapper({"hidden_size": 8, "text_config": None})
    assert not is_wrapper(LlamaConfig())


def test_text_decoder_dict_is_a_copy_of_the_decoders_own_level() -> None:
    text = text_decoder_dict(KIMI_LIKE)
    assert text == KIMI_LIKE["text_config"]
    text["hidden_size"] = 1
    assert KIMI_LIKE["text_config"]["hidden_size"] == 7168
    assert text_decoder_dict({"hidden_size": 8}) == {"hidden_size": 8}


def test_a_text_config_that_is_no_object_is_an_error() -> None:
    with pytest.raises(ModelConfigError, match="text_config is a str, not an object"):
        is_wrapper({"text_config": "llama"})


@pytest.mark.parametrize(
    "stored",
    [
        "language_model.model.norm.weight",  # Kimi-K2.5 / LLaVA as shipped
        "model.language_model.norm.weight",  # as transformers saves a wrapper
    ],
)
def test_a_wrappers_tensor_names_map_onto_the_decoders(stored: str) -> None:
    mapping = decoder_key_mapping(KIMI_LIKE)
    assert decoder_tensor_name(stored, mapping) == "model.norm.weight"
    assert decoder_tensor_name("language_model.lm_head.weight", mapping) == "lm_head.weight"
    # A vision tower's tensor keeps its name: it is no tensor of the decoder.
    assert decoder_tensor_name("vision_tower.model.norm.weight", mapping).startswith("vision")
    # A flat checkpoint already uses the decoder's names.
    assert decoder_key_mapping({"hidden_size": 8}) == {}


def test_rms_norm_eps_is_the_text_decoders() -> None:
    assert rms_norm_eps({"text_config": {"rms_norm_eps": 1e-5}}) == 1e-5
    assert rms_norm_eps({"rms_norm_eps": 1e-6}) == 1e-6
    assert rms_norm_eps({"layer_norm_eps": 1e-5}) is None
    with pytest.raises(ModelConfigError, match="rms_norm_eps"):
        rms_norm_eps({"rms_norm_eps": 1e-6, "text_config": {"rms_norm_eps": 1e-5}})
