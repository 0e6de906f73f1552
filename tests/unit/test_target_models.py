"""The Kimi-K2.5- and Qwen3-shaped fixtures really have the shape the workflow must cope with.

Each test pins one property that the main code relies on or guards against: Kimi's slow
remote-code tokenizer and its real ids, the K2.5 template's thinking and history rules, the
wrapper checkpoint layout, and the silent fast conversion transformers does without remote
code.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.target_models import (
    KIMI_END_OF_TURN,
    KIMI_PAT_STR,
    KIMI_SPECIAL_IDS,
    KIMI_THINK_CLOSE,
    KIMI_THINK_OPEN,
    KIMI_VOCAB_SIZE,
    kimi_text_decoder,
    make_kimi_dir,
    make_qwen3_dir,
    tiktoken_cache,
)
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

GENERATION_PROMPT = "<|im_assistant|>assistant<|im_middle|>"

CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France? I don't know."},
    {"role": "assistant", "content": "Paris.", "reasoning_content": "It's Paris, I think."},
    {"role": "user", "content": "And of Germany?"},
    {"role": "assistant", "content": "Berlin.", "reasoning_content": "That's Berlin."},
]

# An agentic turn in progress: a tool-calling assistant message after the last plain one.
TOOL_TURN: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Need a lookup.",
        "tool_calls": [
            {
                "id": "functions.get_weather:0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "Sunny"},
]


@pytest.fixture(scope="module", autouse=True)
def isolated_tiktoken_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """tiktoken would otherwise serve a stale tiktoken.model cached under the same path."""
    with tiktoken_cache(tmp_path_factory.mktemp("tiktoken-cache")):
        yield


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory: pytest.TempPathFactory, isolated_tiktoken_cache: None) -> Path:
    return make_kimi_dir(tmp_path_factory.mktemp("kimi") / "Kimi-K2.5-tiny")


@pytest.fixture(scope="module")
def kimi_wrapper_dir(
    tmp_path_factory: pytest.TempPathFactory, isolated_tiktoken_cache: None
) -> Path:
    return make_kimi_dir(tmp_path_factory.mktemp("kimi-wrapper") / "Kimi-K2.5-tiny", wrapper=True)


@pytest.fixture(scope="module")
def kimi_tokenizer(kimi_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(kimi_dir, trust_remote_code=True)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen3_dir(tmp_path_factory.mktemp("qwen3") / "Qwen3-tiny")


def render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


# --- Kimi tokenizer -------------------------------------------------------------------------


def test_kimi_dir_ships_remote_code_and_no_tokenizer_json(kimi_dir: Path) -> None:
    names = {p.name for p in kimi_dir.iterdir()}
    assert {"tiktoken.model", "tokenization_kimi.py", "tokenizer_config.json"} <= names
    assert "chat_template.jinja" in names
    assert "tokenizer.json" not in names
    config = json.loads((kimi_dir / "tokenizer_config.json").read_text())
    assert config["auto_map"] == {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    assert config["tokenizer_class"] == "TikTokenTokenizer"


def test_remote_code_tokenizer_is_a_slow_tiktoken_tokenizer(kimi_tokenizer: Any) -> None:
    import tiktoken

    assert type(kimi_tokenizer).__name__ == "TikTokenTokenizer"
    assert type(kimi_tokenizer).__module__.endswith("tokenization_kimi")
    assert kimi_tokenizer.is_fast is False
    assert isinstance(kimi_tokenizer.model, tiktoken.Encoding)
    assert kimi_tokenizer.model._pat_str == KIMI_PAT_STR
    assert kimi_tokenizer.vocab_size == len(kimi_tokenizer) == KIMI_VOCAB_SIZE
    assert kimi_tokenizer.model.decode_single_token_bytes(KIMI_SPECIAL_IDS["<think>"]) == b"<think>"
    # Filler ranks pad the base vocabulary; they are never produced but still decode.
    assert kimi_tokenizer.model.decode_single_token_bytes(163_000).startswith(b"\xff")


def test_special_tokens_have_kimis_ids(kimi_tokenizer: Any) -> None:
    for name, token_id in KIMI_SPECIAL_IDS.items():
        assert kimi_tokenizer.convert_tokens_to_ids(name) == token_id, name
        assert kimi_tokenizer.encode(name) == [token_id], name
        assert kimi_tokenizer.convert_ids_to_tokens(token_id) == name
    assert kimi_tokenizer.convert_ids_to_tokens(163_589) == "<|reserved_token_163589|>"
    ids = (kimi_tokenizer.bos_token_id, kimi_tokenizer.eos_token_id)
    assert ids == (163_584, 163_585)
    assert (kimi_tokenizer.unk_token_id, kimi_tokenizer.pad_token_id) == (163_838, 163_839)
    assert kimi_tokenizer.convert_tokens_to_ids(KIMI_END_OF_TURN) == 163_586
    think = kimi_tokenizer.convert_tokens_to_ids([KIMI_THINK_OPEN, KIMI_THINK_CLOSE])
    assert think == [163_606, 163_607]


@pytest.mark.parametrize("thinking", [True, False])
def test_every_encode_route_agrees_on_a_rendered_chat(kimi_tokenizer: Any, thinking: bool) -> None:
    for messages in (CONVERSATION, TOOL_TURN):
        text = render(kimi_tokenizer, messages, add_generation_prompt=True, thinking=thinking)
        ids = kimi_tokenizer.encode(text)
        assert kimi_tokenizer(text, add_special_tokens=False)["input_ids"] == ids
        assert kimi_tokenizer.encode(text, add_special_tokens=False) == ids
        assert kimi_tokenizer(text)["input_ids"] == ids  # no BOS is added
        assert ids.count(KIMI_SPECIAL_IDS["<|im_end|>"]) == text.count(KIMI_END_OF_TURN)


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! I don't think it's hard.",
        "Übergrößenträger, café, naïve — 北京是中国的首都。 🙂👍🏽",
        "  leading spaces\tand tabs\n\n\nnew lines \r\n",
        "<|im_user|>user<|im_middle|>12345 apples<|im_end|><|reserved_token_163600|>",
    ],
)
def test_decode_inverts_encode(kimi_tokenizer: Any, text: str) -> None:
    ids = kimi_tokenizer.encode(text)
    assert kimi_tokenizer.decode(ids) == text
    assert kimi_tokenizer.decode(ids, skip_special_tokens=False) == text
    assert (
        kimi_tokenizer.convert_tokens_to_string(kimi_tokenizer.convert_ids_to_tokens(ids)) == text
    )


def test_kimis_split_keeps_contractions_whole(kimi_tokenizer: Any) -> None:
    ids = kimi_tokenizer.encode(" don't")
    assert len(ids) == 1
    assert kimi_tokenizer.model.decode_single_token_bytes(ids[0]) == b" don't"


def test_saved_tokenizer_reloads_with_the_same_ids(kimi_tokenizer: Any, tmp_path: Path) -> None:
    kimi_tokenizer.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path, trust_remote_code=True)
    text = render(kimi_tokenizer, CONVERSATION, add_generation_prompt=False)
    assert again.encode(text) == kimi_tokenizer.encode(text)
    assert again.chat_template == kimi_tokenizer.chat_template


# --- Loading without remote code --------------------------------------------------------------


def test_wrapper_dir_without_remote_code_converts_to_other_ids(
    kimi_wrapper_dir: Path, kimi_tokenizer: Any
) -> None:
    # kimi_k25 maps to TokenizersBackend, so transformers counts that as local code, does not
    # ask for trust_remote_code and converts tiktoken.model with GPT-4's split pattern.
    converted = AutoTokenizer.from_pretrained(kimi_wrapper_dir)
    assert converted.is_fast
    assert type(converted).__name__ == "TokenizersBackend"
    assert converted.convert_tokens_to_ids(KIMI_END_OF_TURN) == 163_586
    ours = kimi_tokenizer.encode(" don't")
    theirs = converted.encode(" don't", add_special_tokens=False)
    assert theirs != ours
    assert len(theirs) > len(ours) == 1


def test_plain_dir_without_remote_code_refuses_or_converts(
    kimi_dir: Path, kimi_tokenizer: Any
) -> None:
    # deepseek_v3 has no tokenizer mapping: transformers 5.23 insists on trust_remote_code;
    # 5.19 (sglang 0.5.23's pin, the low end of the range) converts tiktoken.model as for the
    # wrapper above. Either way never the target's ids: target.check_remote_code refuses both.
    try:
        converted = AutoTokenizer.from_pretrained(kimi_dir, trust_remote_code=False)
    except ValueError as exc:
        assert "trust_remote_code" in str(exc)
        return
    assert type(converted).__name__ == "TokenizersBackend"
    theirs = converted.encode(" don't", add_special_tokens=False)
    assert theirs != kimi_tokenizer.encode(" don't")


def test_tiktoken_caches_local_files_by_path(tmp_path: Path) -> None:
    from tiktoken.load import load_tiktoken_bpe

    vocab = tmp_path / "tiktoken.model"
    vocab.write_text("YQ== 0\n")
    with tiktoken_cache(tmp_path / "cache"):
        assert load_tiktoken_bpe(str(vocab)) == {b"a": 0}
        vocab.write_text("Yg== 0\n")
        assert load_tiktoken_bpe(str(vocab)) == {b"a": 0}  # stale: served from the cache
    with tiktoken_cache(""):
        assert load_tiktoken_bpe(str(vocab)) == {b"b": 0}


# --- K2.5 chat template ---------------------------------------------------------------------


def test_generation_prompt_opens_or_skips_thinking(kimi_tokenizer: Any) -> None:
    on = render(kimi_tokenizer, CONVERSATION[:2], add_generation_prompt=True)
    off = render(kimi_tokenizer, CONVERSATION[:2], add_generation_prompt=True, thinking=False)
    assert on.endswith(GENERATION_PROMPT + KIMI_THINK_OPEN)
    assert off.endswith(GENERATION_PROMPT + KIMI_THINK_OPEN + KIMI_THINK_CLOSE)
    assert kimi_tokenizer.encode(on)[-1] == KIMI_SPECIAL_IDS["<think>"]
    assert kimi_tokenizer.encode(off)[-2:] == [163_606, 163_607]


def test_history_turns_lose_their_reasoning(kimi_tokenizer: Any) -> None:
    # Everything up to and including the last plain assistant message is history, so a
    # finished conversation never shows reasoning, not even on its last turn, and neither
    # does the same conversation cut after its first assistant turn.
    empty = KIMI_THINK_OPEN + KIMI_THINK_CLOSE
    whole = render(kimi_tokenizer, CONVERSATION)
    assert whole.count(empty + "Paris.") == 1
    assert whole.count(empty + "Berlin.") == 1
    assert "It's Paris" not in whole
    assert "That's Berlin" not in whole
    first = render(kimi_tokenizer, CONVERSATION[:3])
    assert first.endswith(GENERATION_PROMPT + empty + "Paris." + KIMI_END_OF_TURN)
    assert "It's Paris" not in first
    assert whole.startswith(first)


def test_reasoning_survives_only_in_a_tool_call_turn(kimi_tokenizer: Any) -> None:
    text = render(kimi_tokenizer, TOOL_TURN, add_generation_prompt=True)
    assert GENERATION_PROMPT + "<think>Need a lookup.</think><|tool_calls_section_begin|>" in text
    assert "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nSunny" in text
    off = render(kimi_tokenizer, TOOL_TURN, add_generation_prompt=True, thinking=False)
    assert "Need a lookup." not in off


# --- Kimi model -----------------------------------------------------------------------------


def test_wrapper_config_is_kimi_k25_with_sizes_only_in_text_config(kimi_wrapper_dir: Path) -> None:
    raw = json.loads((kimi_wrapper_dir / "config.json").read_text())
    assert raw["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert raw["model_type"] == "kimi_k25"
    assert "hidden_size" not in raw
    assert "num_hidden_layers" not in raw
    config = AutoConfig.from_pretrained(kimi_wrapper_dir)
    assert type(config).__name__ == "Kimi_K25Config"
    text = config.text_config
    assert (text.model_type, text.hidden_size, text.num_hidden_layers) == ("deepseek_v3", 64, 8)
    assert text.vocab_size == KIMI_VOCAB_SIZE
    generation = json.loads((kimi_wrapper_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == KIMI_SPECIAL_IDS[KIMI_END_OF_TURN]


def test_wrapper_weights_use_k25_checkpoint_names(kimi_wrapper_dir: Path) -> None:
    from safetensors import safe_open

    with safe_open(kimi_wrapper_dir / "model.safetensors", "pt") as f:
        names = list(f.keys())
    assert "language_model.lm_head.weight" in names
    assert "language_model.model.embed_tokens.weight" in names
    assert any(n.startswith("vision_tower.") for n in names)
    assert any(n.startswith("mm_projector.") for n in names)
    assert not any(n.startswith(("model.", "lm_head.")) for n in names)


def test_wrapper_is_not_a_causal_lm_config(kimi_wrapper_dir: Path) -> None:
    with pytest.raises(ValueError, match="Kimi_K25Config"):
        AutoModelForCausalLM.from_pretrained(kimi_wrapper_dir)


def test_text_decoder_of_wrapper_equals_plain_dir(
    kimi_dir: Path, kimi_wrapper_dir: Path, kimi_tokenizer: Any
) -> None:
    decoder = kimi_text_decoder(kimi_wrapper_dir)
    plain = AutoModelForCausalLM.from_pretrained(kimi_dir).eval()
    assert type(plain).__name__ == type(decoder).__name__ == "DeepseekV3ForCausalLM"
    assert plain.dtype == decoder.dtype == torch.bfloat16
    text = render(kimi_tokenizer, CONVERSATION[:2], add_generation_prompt=True)
    ids = torch.tensor([kimi_tokenizer.encode(text)])
    with torch.no_grad():
        ours, theirs = decoder(ids).logits, plain(ids).logits
    assert ours.shape == (1, ids.shape[1], KIMI_VOCAB_SIZE)
    assert torch.equal(ours, theirs)


def test_plain_kimi_model_generates(kimi_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(kimi_dir).eval()
    assert model.generation_config.eos_token_id == KIMI_SPECIAL_IDS[KIMI_END_OF_TURN]
    prompt = torch.tensor(
        [[KIMI_SPECIAL_IDS["<|im_user|>"], 300, 301, KIMI_SPECIAL_IDS["<think>"]]]
    )
    out = model.generate(prompt, max_new_tokens=4, do_sample=False)
    assert out.shape[1] <= prompt.shape[1] + 4
    assert int(out.max()) < KIMI_VOCAB_SIZE


# --- Qwen3 ----------------------------------------------------------------------------------


def test_qwen3_dir_loads_and_renders_thinking(qwen3_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.dtype == torch.bfloat16
    assert model.config.num_hidden_layers == 8
    assert model.config.hidden_size == 64
    assert tokenizer.is_fast
    assert tokenizer.eos_token == "<|im_end|>"
    assert model.config.eos_token_id == tokenizer.eos_token_id
    messages = [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris.", "reasoning_content": "The user asks."},
    ]
    text = render(tokenizer, messages)
    assert "<|im_start|>assistant\n<think>\nThe user asks.\n</think>\n\nParis.<|im_end|>" in text
    off = render(tokenizer, messages[:1], add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
