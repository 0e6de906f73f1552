"""The tiny multimodal targets (``support.vlm_models``) behave like the real ones on images.

For each of Qwen2-VL and Kimi-K2.5: the real chat template renders an image part as one
placeholder, the processor expands it to one token per merged 2x2 patch block, the model
runs on CPU with the pixel inputs and greedy ``generate`` works, and the image reaches the
text: hidden states after the image change with the image, those before it do not.

The main ``.venv`` has no torchvision: Qwen2-VL runs there through its PIL image processor
(``qwen2_vl_processor``), Kimi-K2.5 with hand-built pixel inputs (``kimi_pixel_inputs``).
The tests of the torchvision-only processors skip there and say so; they run in
``.venv-sglang`` (``PYTHONPATH=tests .venv-sglang/bin/pytest --noconftest <this file>``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from support.target_models import KIMI_SPECIAL_IDS, tiktoken_cache
from support.vlm_models import (
    KIMI_IMAGE_TOKEN,
    KIMI_IMAGE_TOKEN_ID,
    KIMI_MEDIA_IDS,
    QWEN2_VL_IMAGE_TOKEN,
    kimi_num_image_tokens,
    kimi_pixel_inputs,
    make_kimi_vlm_dir,
    make_qwen2_vl_dir,
    qwen2_vl_image_only_processor_class,
    qwen2_vl_processor,
    torchvision_available,
)
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

QUESTION = "Describe the image."
# (width, height) -> image tokens. Qwen2-VL rounds each side to a multiple of 28 (100x60
# -> 112x56: 8x4 patches), Kimi pads it up (100x60 -> 112x84: 8x6 patches); both merge 2x2.
QWEN_TOKENS = {(56, 56): 4, (100, 60): 8}
KIMI_TOKENS = {(56, 56): 4, (100, 60): 12}

KIMI_IMAGE_PART = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>\n"
QWEN_IMAGE_PART = "<|vision_start|><|image_pad|><|vision_end|>"


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    """Random pixels: two seeds give images whose every patch differs."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def image_messages(image: Image.Image | None = None) -> list[dict[str, Any]]:
    part: dict[str, Any] = {"type": "image"} if image is None else {"type": "image", "image": image}
    return [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}]


def image_span(input_ids: torch.Tensor, image_token_id: int) -> tuple[int, int]:
    """First and one-past-last position of the image tokens, checked to be one run."""
    positions = (input_ids == image_token_id).nonzero().flatten().tolist()
    first, end = positions[0], positions[-1] + 1
    assert positions == list(range(first, end))
    return first, end


def assert_image_reaches_text(
    model: Any, input_ids: torch.Tensor, pixels: list[dict[str, torch.Tensor]], image_id: int
) -> None:
    """Last-layer states of one prompt under two images: equal before the image (causal),
    different at every text position after it."""
    states = []
    for extra in pixels:
        with torch.inference_mode():
            out = model(input_ids=input_ids, **extra, output_hidden_states=True)
        states.append(out.hidden_states[-1][0].float())
    first, end = image_span(input_ids[0], image_id)
    assert end < input_ids.shape[1]
    assert torch.equal(states[0][:first], states[1][:first])
    after = (states[0][end:] - states[1][end:]).abs().amax(dim=-1)
    assert bool((after > 1e-3).all()), after


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The models' matrices are tiny: a second OpenMP thread only adds wake-ups, and on a
    busy 2-core machine it made a 45-token Kimi forward 2.3 s instead of 0.05 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def isolated_tiktoken_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """tiktoken would otherwise serve a stale tiktoken.model cached under the same path."""
    with tiktoken_cache(tmp_path_factory.mktemp("tiktoken-cache")):
        yield


# -- Qwen2-VL ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen2_vl_dir(tmp_path_factory.mktemp("qwen2-vl") / "Qwen2-VL-tiny")


@pytest.fixture(scope="module")
def qwen_processor(qwen_dir: Path) -> Any:
    return qwen2_vl_processor(qwen_dir)


@pytest.fixture(scope="module")
def qwen_model(qwen_dir: Path) -> Any:
    return AutoModelForImageTextToText.from_pretrained(qwen_dir).eval()


@pytest.fixture(scope="module")
def qwen_prompt(qwen_processor: Any) -> str:
    return qwen_processor.apply_chat_template(
        image_messages(), tokenize=False, add_generation_prompt=True
    )


def test_qwen2_vl_directory(qwen_dir: Path, qwen_processor: Any, qwen_model: Any) -> None:
    config = json.loads((qwen_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2VLForConditionalGeneration"]
    tokenizer = qwen_processor.tokenizer
    assert config["image_token_id"] == tokenizer.convert_tokens_to_ids(QWEN2_VL_IMAGE_TOKEN)
    assert config["image_token_id"] == qwen_processor.image_token_id
    assert config["text_config"]["vocab_size"] == len(tokenizer)
    assert type(qwen_model).__name__ == "Qwen2VLForConditionalGeneration"
    assert qwen_model.dtype == torch.bfloat16
    # The saved type names the base class; the backend is picked where it is loaded.
    preprocessor = json.loads((qwen_dir / "preprocessor_config.json").read_text())
    assert preprocessor["image_processor_type"] == "Qwen2VLImageProcessor"
    backend = "Qwen2VLImageProcessor" if torchvision_available() else "Qwen2VLImageProcessorPil"
    assert type(AutoImageProcessor.from_pretrained(qwen_dir)).__name__ == backend
    assert type(qwen_processor.image_processor).__name__ == backend


def test_qwen2_vl_build_is_deterministic(qwen_dir: Path, tmp_path: Path) -> None:
    again = make_qwen2_vl_dir(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (qwen_dir / name).read_bytes(), name


def test_qwen2_vl_template_renders_one_placeholder(qwen_prompt: str) -> None:
    assert qwen_prompt == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{QWEN_IMAGE_PART}{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert qwen_prompt.count(QWEN2_VL_IMAGE_TOKEN) == 1


@pytest.mark.parametrize(("size", "tokens"), QWEN_TOKENS.items(), ids=str)
def test_qwen2_vl_processor_expands_the_placeholder(
    qwen_processor: Any, qwen_prompt: str, size: tuple[int, int], tokens: int
) -> None:
    batch = qwen_processor(text=[qwen_prompt], images=[noise_image(*size, 0)], return_tensors="pt")
    grid = batch["image_grid_thw"][0]
    assert int(grid.prod()) // qwen_processor.image_processor.merge_size**2 == tokens
    assert batch["pixel_values"].shape[0] == int(grid.prod())
    ids = batch["input_ids"][0]
    first, end = image_span(ids, qwen_processor.image_token_id)
    assert end - first == tokens
    # Everything else is the unexpanded prompt's tokens.
    plain = qwen_processor.tokenizer(qwen_prompt)["input_ids"]
    assert [*ids[:first].tolist(), qwen_processor.image_token_id, *ids[end:].tolist()] == plain


def test_qwen2_vl_tokenized_chat_template_is_expanded(
    qwen_processor: Any, qwen_prompt: str
) -> None:
    """With an image object in the message, ``tokenize=True`` runs the processor: a batch
    (one list per conversation) of already expanded ids; ``return_dict`` adds the pixels."""
    image = noise_image(56, 56, 0)
    ids = qwen_processor.apply_chat_template(
        image_messages(image), tokenize=True, add_generation_prompt=True
    )
    batch = qwen_processor(text=[qwen_prompt], images=[image], return_tensors="pt")
    assert ids == batch["input_ids"].tolist()
    as_dict = qwen_processor.apply_chat_template(
        image_messages(image), tokenize=True, add_generation_prompt=True, return_dict=True
    )
    assert {"input_ids", "pixel_values", "image_grid_thw"} <= set(as_dict)


def test_qwen2_vl_image_reaches_the_text(
    qwen_processor: Any, qwen_model: Any, qwen_prompt: str
) -> None:
    batches = [
        qwen_processor(text=[qwen_prompt], images=[noise_image(56, 56, seed)], return_tensors="pt")
        for seed in (1, 2)
    ]
    assert torch.equal(batches[0]["input_ids"], batches[1]["input_ids"])
    # Qwen2-VL's mrope positions need mm_token_type_ids (transformers 5.23 refuses a
    # forward with image_grid_thw without them).
    keys = ("pixel_values", "image_grid_thw", "mm_token_type_ids")
    pixels = [{k: b[k] for k in keys} for b in batches]
    assert_image_reaches_text(
        qwen_model, batches[0]["input_ids"], pixels, qwen_processor.image_token_id
    )


def test_qwen2_vl_generate_runs_on_cpu(
    qwen_processor: Any, qwen_model: Any, qwen_prompt: str
) -> None:
    batch = qwen_processor(
        text=[qwen_prompt], images=[noise_image(100, 60, 1)], return_tensors="pt"
    )
    out = qwen_model.generate(**batch, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    prompt_len = batch["input_ids"].shape[1]
    assert out.shape == (1, prompt_len + 4)
    assert torch.equal(out[:, :prompt_len], batch["input_ids"])


def test_qwen2_vl_autoprocessor_needs_torchvision(qwen_dir: Path) -> None:
    """Qwen2VLProcessor always loads a video processor, which is torchvision-only."""
    if torchvision_available():
        pytest.skip("torchvision is installed here: AutoProcessor loads")
    from transformers import AutoProcessor

    with pytest.raises(ImportError, match="Qwen2VLVideoProcessor requires the Torchvision"):
        AutoProcessor.from_pretrained(qwen_dir)


def test_qwen2_vl_autoprocessor_with_torchvision(qwen_dir: Path, qwen_prompt: str) -> None:
    pytest.importorskip(
        "torchvision", reason="Qwen2VLProcessor needs its torchvision video processor"
    )
    from transformers import AutoProcessor

    auto = AutoProcessor.from_pretrained(qwen_dir)
    assert type(auto).__name__ == "Qwen2VLProcessor"
    pil = qwen2_vl_image_only_processor_class().from_pretrained(qwen_dir, backend="pil")
    for size in QWEN_TOKENS:
        image = noise_image(*size, 0)
        a = auto(text=[qwen_prompt], images=[image], return_tensors="pt")
        b = pil(text=[qwen_prompt], images=[image], return_tensors="pt")
        assert torch.equal(a["input_ids"], b["input_ids"])
        assert torch.equal(a["image_grid_thw"], b["image_grid_thw"])
    # The pixels agree only where neither backend resizes (56x56 is already 28-aligned):
    # PIL's bicubic and torchvision's differ (up to 0.27 after normalizing, 100x60 image).
    image = noise_image(56, 56, 0)
    a = auto(text=[qwen_prompt], images=[image], return_tensors="pt")
    b = pil(text=[qwen_prompt], images=[image], return_tensors="pt")
    torch.testing.assert_close(a["pixel_values"], b["pixel_values"], atol=1e-5, rtol=0)


# -- Kimi-K2.5 -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory: pytest.TempPathFactory, isolated_tiktoken_cache: None) -> Path:
    return make_kimi_vlm_dir(tmp_path_factory.mktemp("kimi-vlm") / "Kimi-K2.5-tiny")


@pytest.fixture(scope="module")
def kimi_tokenizer(kimi_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(kimi_dir, trust_remote_code=True)


@pytest.fixture(scope="module")
def kimi_loaded(kimi_dir: Path) -> tuple[Any, dict[str, Any]]:
    model, info = AutoModelForImageTextToText.from_pretrained(kimi_dir, output_loading_info=True)
    return model.eval(), info


@pytest.fixture(scope="module")
def kimi_prompt(kimi_tokenizer: Any) -> str:
    return kimi_tokenizer.apply_chat_template(
        image_messages(), tokenize=False, add_generation_prompt=True
    )


def kimi_input_ids(tokenizer: Any, prompt: str, width: int, height: int) -> torch.Tensor:
    """The prompt with <|media_pad|> expanded the way Kimi_K25Processor does."""
    tokens = kimi_num_image_tokens(height, width)
    return torch.tensor(
        [tokenizer.encode(prompt.replace(KIMI_IMAGE_TOKEN, KIMI_IMAGE_TOKEN * tokens))]
    )


def kimi_pixels(image: Image.Image, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    pixels = kimi_pixel_inputs(image)
    return {**pixels, "pixel_values": pixels["pixel_values"].to(dtype)}


def test_kimi_vlm_tokenizer_knows_the_media_tokens(kimi_dir: Path, kimi_tokenizer: Any) -> None:
    for name, token_id in {**KIMI_MEDIA_IDS, "[BOS]": KIMI_SPECIAL_IDS["[BOS]"]}.items():
        assert kimi_tokenizer.encode(name) == [token_id]
        assert kimi_tokenizer.convert_tokens_to_ids(name) == token_id
    config = json.loads((kimi_dir / "config.json").read_text())
    assert config["image_token_id"] == KIMI_IMAGE_TOKEN_ID
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"]


def test_kimi_vlm_template_renders_one_placeholder(kimi_prompt: str) -> None:
    assert kimi_prompt == (
        f"<|im_user|>user<|im_middle|>{KIMI_IMAGE_PART}{QUESTION}<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>"
    )
    assert kimi_prompt.count(KIMI_IMAGE_TOKEN) == 1


def test_kimi_vlm_checkpoint_loads_whole(
    kimi_dir: Path, kimi_loaded: tuple[Any, dict[str, Any]]
) -> None:
    """Every tensor under K2.5's names is read and every parameter is written: no
    random-init leftovers in the tower or projector."""
    from safetensors import safe_open

    model, info = kimi_loaded
    assert type(model).__name__ == "Kimi_K25ForConditionalGeneration"
    assert model.dtype == torch.bfloat16
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    with safe_open(kimi_dir / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
    vision = {n for n in names if not n.startswith("language_model.")}
    assert {n.split(".")[0] for n in vision} == {"vision_tower", "mm_projector"}
    assert "vision_tower.encoder.blocks.0.wqkv.weight" in vision
    assert "mm_projector.proj.2.weight" in vision


@pytest.mark.parametrize(("size", "tokens"), KIMI_TOKENS.items(), ids=str)
def test_kimi_vlm_pixel_inputs(size: tuple[int, int], tokens: int) -> None:
    width, height = size
    pixels = kimi_pixel_inputs(noise_image(width, height, 0))
    grid = pixels["image_grid_thw"]
    assert int(grid.prod()) // 4 == tokens == kimi_num_image_tokens(height, width)
    assert pixels["pixel_values"].shape == (int(grid.prod()), 3, 14, 14)


def test_kimi_vlm_image_reaches_the_text(
    kimi_tokenizer: Any, kimi_loaded: tuple[Any, dict[str, Any]], kimi_prompt: str
) -> None:
    model, _ = kimi_loaded
    input_ids = kimi_input_ids(kimi_tokenizer, kimi_prompt, 56, 56)
    pixels = [kimi_pixels(noise_image(56, 56, seed), model.dtype) for seed in (1, 2)]
    assert_image_reaches_text(model, input_ids, pixels, KIMI_IMAGE_TOKEN_ID)


def test_kimi_vlm_pixels_must_be_in_the_model_dtype(
    kimi_tokenizer: Any, kimi_loaded: tuple[Any, dict[str, Any]], kimi_prompt: str
) -> None:
    """Unlike Qwen2-VL's, transformers' MoonViT does not cast: the processor's float32
    pixels into the bf16 checkpoint fail in the patch embedding."""
    model, _ = kimi_loaded
    input_ids = kimi_input_ids(kimi_tokenizer, kimi_prompt, 56, 56)
    with pytest.raises(RuntimeError, match="should be the same"), torch.inference_mode():
        model(input_ids=input_ids, **kimi_pixel_inputs(noise_image(56, 56, 1)))


def test_kimi_vlm_generate_runs_on_cpu(
    kimi_tokenizer: Any, kimi_loaded: tuple[Any, dict[str, Any]], kimi_prompt: str
) -> None:
    model, _ = kimi_loaded
    input_ids = kimi_input_ids(kimi_tokenizer, kimi_prompt, 100, 60)
    pixels = kimi_pixels(noise_image(100, 60, 1), model.dtype)
    out = model.generate(
        input_ids=input_ids, **pixels, max_new_tokens=4, min_new_tokens=4, do_sample=False
    )
    assert out.shape == (1, input_ids.shape[1] + 4)
    assert torch.equal(out[:, : input_ids.shape[1]], input_ids)


def test_kimi_vlm_processor_matches_the_hand_built_inputs(
    kimi_dir: Path, kimi_tokenizer: Any, kimi_prompt: str
) -> None:
    pytest.importorskip("torchvision", reason="Kimi_K25ImageProcessor is torchvision-only")
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(kimi_dir, trust_remote_code=True)
    assert type(processor).__name__ == "Kimi_K25Processor"
    assert processor.image_token_id == KIMI_IMAGE_TOKEN_ID
    for (width, height), tokens in KIMI_TOKENS.items():
        image = noise_image(width, height, 0)
        batch = processor(text=[kimi_prompt], images=[image], return_tensors="pt")
        assert torch.equal(
            batch["input_ids"], kimi_input_ids(kimi_tokenizer, kimi_prompt, width, height)
        )
        first, end = image_span(batch["input_ids"][0], KIMI_IMAGE_TOKEN_ID)
        assert end - first == tokens
        hand = kimi_pixel_inputs(image)
        assert torch.equal(batch["image_grid_thw"], hand["image_grid_thw"])
        torch.testing.assert_close(batch["pixel_values"], hand["pixel_values"], atol=1e-6, rtol=0)
    # tokenize=True with an image object: the processor's expanded ids, as a batch.
    image = noise_image(56, 56, 0)
    ids = processor.apply_chat_template(
        image_messages(image), tokenize=True, add_generation_prompt=True
    )
    assert ids == kimi_input_ids(kimi_tokenizer, kimi_prompt, 56, 56).tolist()
