"""Offline multimodal (image) target directories: a tiny Qwen2-VL and a tiny Kimi-K2.5 VLM.

No hub: everything is built here, small, random and seeded, in the shape the real targets ship.

Qwen2-VL (``make_qwen2_vl_dir``) stands for the Qwen-VL family (mrope 3-D positions,
``<|image_pad|>`` expanded by the processor). Its directory is what ``save_pretrained`` of a
real Qwen2-VL-Instruct writes: ``config.json`` + weights, a fast tokenizer with Qwen2-VL's
special tokens and real chat template, ``preprocessor_config.json`` (``Qwen2VLImageProcessor``,
with tiny ``min/max_pixels``) and ``processor_config.json`` (``Qwen2VLProcessor``).

* In an environment without torchvision (the main ``.venv``) ``AutoImageProcessor`` picks the
  PIL backend (``Qwen2VLImageProcessorPil``) on its own: ``image_processor_type`` names the
  base class and the backend is resolved at load time (torchvision if importable, else PIL).
  The saved name is the same either way; there is nothing to select in the file.
* ``AutoProcessor`` still fails there: ``Qwen2VLProcessor.__init__`` takes a video processor,
  ``ProcessorMixin`` loads every ``__init__`` sub-processor, and ``Qwen2VLVideoProcessor``
  exists only with torchvision. :func:`qwen2_vl_processor` works in both environments
  (``qwen2_vl_image_only_processor_class`` where torchvision is missing).

Kimi-K2.5 (``make_kimi_vlm_dir``) is ``make_kimi_dir(wrapper=True)`` (K2.5's remote-code
tokenizer, real chat template, DeepSeek-V3 decoder under ``language_model.*``) made runnable
as a VLM: every MoonViT and projector tensor under K2.5's own checkpoint names, the media
tokens named in the tokenizer, and a ``Kimi_K25Processor`` config. transformers'
``Kimi_K25ImageProcessor`` is torchvision-only (no PIL backend), so :func:`kimi_pixel_inputs`
builds its output by hand for the images that need no resize.

Checked facts (transformers 5.23 in ``.venv``, 5.19 with torchvision 0.29.1 in ``.venv-sglang``;
``tests/unit/test_vlm_models.py`` asserts the ones marked [T]):

* Both templates render an image part as ONE placeholder [T]; the processor expands it to
  ``image_grid_thw.prod() // merge_size**2`` copies [T]. ``processor.apply_chat_template(...,
  tokenize=True)`` with an image object in the message runs the processor: a batch (list of
  lists) of expanded ids [T]; without an image object it raises ("Found 1 <|image_pad|>
  tokens in the text but no images were passed"). The tokenizer's own
  ``apply_chat_template(tokenize=True)`` returns a ``BatchEncoding`` with one unexpanded
  placeholder.
* Qwen2-VL's forward wants ``mm_token_type_ids`` (the processor returns it) whenever
  ``image_grid_thw`` comes with ``input_ids``: without it, a ValueError (mrope positions).
  It casts float32 pixels to the model's dtype; K2.5's MoonViT does not [T].
* PIL and torchvision Qwen2-VL processors give the same ids and grids but different pixels
  where they resize (bicubic: up to 0.27 after normalizing for 100x60); 56x56 is not resized.
* vLLM 0.32 (CPU, ``.venv-vllm``) cannot serve Qwen2-VL without torchvision: its model
  module imports ``transformers...image_processing_qwen2_vl``, which imports torchvision.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from support.target_models import make_kimi_dir

if TYPE_CHECKING:
    import torch
    from PIL import Image
    from transformers import (
        PreTrainedTokenizerFast,
        ProcessorMixin,
        Qwen2_5_VLConfig,
        Qwen2VLConfig,
    )

# Qwen/Qwen2-VL-7B-Instruct chat_template.json, verbatim: an image part (``{"type":
# "image"}``, or any part with an ``image``/``image_url`` key) renders as one
# <|vision_start|><|image_pad|><|vision_end|>, which the processor expands.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2-VL's added tokens in its own order (151643..151656 in the real vocabulary); here
# they follow a 400-token byte-level BPE, so the ids are small but the order is the same.
QWEN2_VL_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
QWEN2_VL_IMAGE_TOKEN = "<|image_pad|>"

# Real Qwen2-VL: 14-pixel patches, 2x2 merge, 2 frames per temporal patch (an image is its
# own two frames). min_pixels is the real one (56*56); max_pixels (real: 28*28*16384) is cut
# to 16 merged tokens' worth, so any image costs at most 16 image tokens.
QWEN2_VL_PATCH_SIZE = 14
QWEN2_VL_MERGE_SIZE = 2
QWEN2_VL_MIN_PIXELS = 56 * 56
QWEN2_VL_MAX_PIXELS = 28 * 28 * 16

_QWEN2_VL_CORPUS = [
    "You are a helpful assistant.",
    "Describe the image. What is in this picture?",
    "A red square on a blue field, and a small green circle in the corner.",
    "The image shows a cat sitting on a chair next to the window.",
    "system user assistant",
]

# Kimi-K2.5's media tokens (tokenizer_config.json added_tokens_decoder; Kimi_K25Config's
# vision_start/end and image token ids). make_kimi_dir leaves these ids reserved
# (<|reserved_token_163605|>), so its tokenizer cannot see <|media_pad|> in text.
KIMI_MEDIA_IDS: dict[str, int] = {
    "<|media_begin|>": 163602,
    "<|media_content|>": 163603,
    "<|media_end|>": 163604,
    "<|media_pad|>": 163605,
}
KIMI_IMAGE_TOKEN = "<|media_pad|>"
KIMI_IMAGE_TOKEN_ID = KIMI_MEDIA_IDS[KIMI_IMAGE_TOKEN]

# Kimi_K25ImageProcessor's defaults (IMAGENET_STANDARD mean/std, 14-pixel patches, 2x2
# merge), with a small patch budget (real: 16,384 patches, 512 per side) so a stray large
# image stays cheap on the tiny model.
KIMI_PATCH_SIZE = 14
KIMI_MERGE_SIZE = 2
KIMI_MAX_PATCHES = 256
KIMI_MAX_PATCHES_PER_SIDE = 32
KIMI_IMAGE_MEAN = (0.5, 0.5, 0.5)
KIMI_IMAGE_STD = (0.5, 0.5, 0.5)


def torchvision_available() -> bool:
    """Whether the torchvision image/video processors can run here (not in the main .venv)."""
    return importlib.util.find_spec("torchvision") is not None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def qwen2_vl_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a few sentences, Qwen2-VL's special tokens after it, and
    the real Qwen2-VL chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_QWEN2_VL_CORPUS * 4, trainer)
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in QWEN2_VL_SPECIAL_TOKENS]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
    )


def qwen2_vl_config(
    tokenizer: PreTrainedTokenizerFast, *, qwen2_5: bool = False
) -> Qwen2VLConfig | Qwen2_5_VLConfig:
    """Tiny sizes with heads of 32 (vLLM's CPU attention runs 32 and up, see
    ``make_qwen3_dir``) in the decoder and the vision tower; mrope sections scaled from the
    real [16, 24, 24] (half of head_dim 128) to [4, 6, 6] (half of 32). ``qwen2_5``: the
    Qwen2.5-VL config (the same decoder and tokens, its own vision tower)."""
    from transformers import Qwen2VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN2_VL_SPECIAL_TOKENS}
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,  # three distinct aux layers below the last
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1_000_000.0,
            "mrope_section": [4, 6, 6],
        },
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    vision = {
        "depth": 1,
        "embed_dim": 64,
        "hidden_size": 64,  # the merger's output: the decoder's hidden size
        "num_heads": 2,
        "mlp_ratio": 2,
        "patch_size": QWEN2_VL_PATCH_SIZE,
        "spatial_merge_size": QWEN2_VL_MERGE_SIZE,
        "temporal_patch_size": 2,
    }
    config_class: type[Qwen2VLConfig | Qwen2_5_VLConfig] = Qwen2VLConfig
    if qwen2_5:
        from transformers import Qwen2_5_VLConfig

        config_class = Qwen2_5_VLConfig
        # Qwen2.5-VL's tower: windowed attention (one 28-pixel window here) except in the
        # blocks fullatt_block_indexes names, an MLP of its own width, a merger to the
        # decoder's width.
        vision = {
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "out_hidden_size": 64,
            "patch_size": QWEN2_VL_PATCH_SIZE,
            "spatial_merge_size": QWEN2_VL_MERGE_SIZE,
            "temporal_patch_size": 2,
            "window_size": 2 * QWEN2_VL_PATCH_SIZE * QWEN2_VL_MERGE_SIZE,
            "fullatt_block_indexes": [1],
        }
    return config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[QWEN2_VL_IMAGE_TOKEN],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        dtype="bfloat16",
    )


# A processor shipped as remote code (as Kimi-K2.5's is): Qwen2VLProcessor without its video
# processor, so that ``AutoProcessor.from_pretrained(dir, trust_remote_code=True)`` loads
# where torchvision is missing (the main test venv). See qwen2_vl_image_only_processor_class.
_IMAGE_ONLY_PROCESSOR_CODE = '''"""Qwen2VLProcessor without its video processor (images, text)."""

from transformers import Qwen2VLProcessor
from transformers.processing_utils import ProcessorMixin


class Qwen2VLImageOnlyProcessor(Qwen2VLProcessor):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
        self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
'''


def make_qwen2_vl_dir(out: Path, *, remote_processor: bool = False, qwen2_5: bool = False) -> Path:
    """A complete tiny random Qwen2-VL-Instruct directory at ``out`` (created if missing).

    ``remote_processor``: the processor is remote code (``processing_qwen2_vl_images.py``,
    ``auto_map``) without the video part, so ``AutoProcessor`` loads it without torchvision
    (with ``trust_remote_code``), as the pipeline loads a target's processor.

    ``qwen2_5``: Qwen2.5-VL-Instruct instead (``Qwen2_5_VLForConditionalGeneration``, a
    2-block windowed vision tower, ``Qwen2_5_VLProcessor``): vLLM's Qwen2.5-VL declares
    ``SupportsEagle3``, which its hidden-state extraction needs; its Qwen2-VL does not.

    Decoder: 4 layers, hidden 64, 2 heads of 32; vision tower: 1 block, width 64, 2 heads,
    14-pixel patches, 2x2 merge into the decoder's width. bf16 like the real checkpoint.
    A 56x56 image is 4 image tokens, 100x60 (width x height) is 8. Seeded: the same
    bytes on every build. Takes well under a second.
    """
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = qwen2_vl_tokenizer()
    torch.manual_seed(0)
    config = qwen2_vl_config(tokenizer, qwen2_5=qwen2_5)
    model_class = Qwen2_5_VLForConditionalGeneration if qwen2_5 else Qwen2VLForConditionalGeneration
    model = model_class(config).to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # Either backend saves image_processor_type "Qwen2VLImageProcessor" (the base name).
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=QWEN2_VL_MIN_PIXELS,
        max_pixels=QWEN2_VL_MAX_PIXELS,
        patch_size=QWEN2_VL_PATCH_SIZE,
        merge_size=QWEN2_VL_MERGE_SIZE,
    )
    image_processor.save_pretrained(out)
    # What Qwen2VLProcessor.save_pretrained writes (it cannot be built without torchvision).
    # No video_preprocessor_config.json, like the hub repo: the video processor then reads
    # preprocessor_config.json.
    processor_config: dict[str, Any] = {
        "processor_class": "Qwen2_5_VLProcessor" if qwen2_5 else "Qwen2VLProcessor"
    }
    if remote_processor:
        (out / "processing_qwen2_vl_images.py").write_text(_IMAGE_ONLY_PROCESSOR_CODE)
        processor_config = {
            "processor_class": "Qwen2VLImageOnlyProcessor",
            "auto_map": {"AutoProcessor": "processing_qwen2_vl_images.Qwen2VLImageOnlyProcessor"},
        }
    _write_json(out / "processor_config.json", processor_config)
    return out


def qwen2_vl_image_only_processor_class() -> type[ProcessorMixin]:
    """A Qwen2VLProcessor subclass that loads without torchvision (built on call, so that
    importing this module does not import transformers' processors)."""
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class Qwen2VLImageOnlyProcessor(Qwen2VLProcessor):
        """Qwen2VLProcessor without its video processor: the attributes ProcessorMixin loads
        are read off ``__init__``'s parameters, so leaving ``video_processor`` out of them is
        what lets ``from_pretrained`` run without torchvision. Images and text behave as in
        Qwen2VLProcessor (same methods); there is no video processor for videos."""

        def __init__(
            self,
            image_processor: Any = None,
            tokenizer: Any = None,
            chat_template: str | None = None,
            **kwargs: Any,
        ) -> None:
            self.image_token = getattr(tokenizer, "image_token", QWEN2_VL_IMAGE_TOKEN)
            self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return Qwen2VLImageOnlyProcessor


def qwen2_vl_processor(model_dir: Path) -> ProcessorMixin:
    """The directory's processor: ``AutoProcessor`` where torchvision is installed, else the
    image-only :class:`Qwen2VLProcessor` subclass (PIL image processor, same tokenizer and
    template, same expansion of <|image_pad|>)."""
    if torchvision_available():
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(model_dir)
    return qwen2_vl_image_only_processor_class().from_pretrained(model_dir)


def _kimi_vision_sizes(config: dict[str, Any]) -> dict[str, int]:
    vision = config["vision_config"]
    merge_h, merge_w = vision.get("merge_kernel_size", [2, 2])
    return {
        "width": vision["hidden_size"],
        "mlp": vision["intermediate_size"],
        "layers": vision["num_hidden_layers"],
        "patch": vision["patch_size"],
        "pos_h": vision["pos_emb_height"],
        "pos_w": vision["pos_emb_width"],
        "merged": vision["hidden_size"] * merge_h * merge_w,
        "text": config["text_config"]["hidden_size"],
    }


def kimi_vision_tensors(config: dict[str, Any], seed: int = 1) -> dict[str, torch.Tensor]:
    """Every MoonViT and projector tensor of a K2.5 checkpoint, random, under K2.5's own
    names (what SGLang's and transformers' loaders read: fused ``wqkv``, ``norm0``/``norm1``,
    ``mlp.fc0``/``fc1``, ``mm_projector.proj.0``/``proj.2``), in bf16.

    Linear weights are scaled by 1/sqrt(fan_in) and norms start at 1, so the image signal
    reaches the decoder at the scale of its token embeddings instead of vanishing.
    """
    import torch

    s = _kimi_vision_sizes(config)
    generator = torch.Generator().manual_seed(seed)

    def linear(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=generator) / math.sqrt(cols)

    def small(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.02

    def norm(prefix: str, width: int) -> dict[str, torch.Tensor]:
        return {
            f"{prefix}.weight": 1.0 + small(width),
            f"{prefix}.bias": small(width),
        }

    width, patch = s["width"], s["patch"]
    tensors: dict[str, torch.Tensor] = {
        "vision_tower.patch_embed.proj.weight": torch.randn(
            width, 3, patch, patch, generator=generator
        )
        / math.sqrt(3 * patch * patch),
        "vision_tower.patch_embed.proj.bias": small(width),
        "vision_tower.patch_embed.pos_emb.weight": small(s["pos_h"], s["pos_w"], width),
        **norm("vision_tower.encoder.final_layernorm", width),
        **norm("mm_projector.pre_norm", width),
        "mm_projector.proj.0.weight": linear(s["merged"], s["merged"]),
        "mm_projector.proj.0.bias": small(s["merged"]),
        "mm_projector.proj.2.weight": linear(s["text"], s["merged"]),
        "mm_projector.proj.2.bias": small(s["text"]),
    }
    for i in range(s["layers"]):
        block = f"vision_tower.encoder.blocks.{i}"
        tensors |= {
            **norm(f"{block}.norm0", width),
            **norm(f"{block}.norm1", width),
            f"{block}.wqkv.weight": linear(3 * width, width),
            f"{block}.wqkv.bias": small(3 * width),
            f"{block}.wo.weight": linear(width, width),
            f"{block}.wo.bias": small(width),
            f"{block}.mlp.fc0.weight": linear(s["mlp"], width),
            f"{block}.mlp.fc0.bias": small(s["mlp"]),
            f"{block}.mlp.fc1.weight": linear(width, s["mlp"]),
            f"{block}.mlp.fc1.bias": small(width),
        }
    return {name: t.to(torch.bfloat16).contiguous() for name, t in tensors.items()}


def _add_kimi_media_tokens(out: Path) -> None:
    """Name K2.5's media ids in tokenizer_config.json (the remote-code tokenizer reads its
    special names from ``added_tokens_decoder``; unnamed ids stay reserved)."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for name, token_id in KIMI_MEDIA_IDS.items():
        config["added_tokens_decoder"][str(token_id)] = {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    extra = config["additional_special_tokens"]
    config["additional_special_tokens"] = extra + [t for t in KIMI_MEDIA_IDS if t not in extra]
    _write_json(path, config)
    special = json.loads((out / "special_tokens_map.json").read_text())
    special["additional_special_tokens"] = config["additional_special_tokens"]
    _write_json(out / "special_tokens_map.json", special)


def _write_kimi_processor_configs(out: Path) -> None:
    """transformers' own K2.5 processor classes (``Kimi_K25Processor`` with
    ``Kimi_K25ImageProcessor``), not the hub repo's remote-code processor."""
    _write_json(out / "processor_config.json", {"processor_class": "Kimi_K25Processor"})
    _write_json(
        out / "preprocessor_config.json",
        {
            "image_processor_type": "Kimi_K25ImageProcessor",
            "processor_class": "Kimi_K25Processor",
            "do_resize": True,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "do_convert_rgb": True,
            "image_mean": list(KIMI_IMAGE_MEAN),
            "image_std": list(KIMI_IMAGE_STD),
            "resample": 3,
            "patch_size": KIMI_PATCH_SIZE,
            "merge_size": KIMI_MERGE_SIZE,
            "max_patches": KIMI_MAX_PATCHES,
            "size": {
                "max_height": KIMI_MAX_PATCHES_PER_SIDE,
                "max_width": KIMI_MAX_PATCHES_PER_SIDE,
            },
        },
    )


def make_kimi_vlm_dir(out: Path, *, k25_attention: bool = False) -> Path:
    """``make_kimi_dir(out, wrapper=True)`` with a runnable tiny MoonViT.

    Same tokenizer (plus the media tokens), chat template, config.json and decoder weights;
    the wrapper's token vision tensors are replaced by a full random tower and projector
    (:func:`kimi_vision_tensors`: 1 block, width 16, 2 heads, 14-pixel patches, 2x2 merge
    into the decoder's 64), and a processor config is added. A 56x56 image is 4
    ``<|media_pad|>`` tokens, 100x60 (width x height) is 12 (padded to 112x84). As with
    ``make_kimi_dir``, point ``TIKTOKEN_CACHE_DIR`` somewhere fresh (``tiktoken_cache``).
    ``k25_attention``: K2.5's MLA head dimensions in the decoder (``make_kimi_dir``).
    """
    from safetensors.torch import load_file, save_file

    make_kimi_dir(out, wrapper=True, k25_attention=k25_attention)
    _add_kimi_media_tokens(out)
    config = json.loads((out / "config.json").read_text())
    path = out / "model.safetensors"
    tensors = {k: v for k, v in load_file(path).items() if k.startswith("language_model.")}
    tensors |= kimi_vision_tensors(config)
    save_file(tensors, path, metadata={"format": "pt"})
    _write_kimi_processor_configs(out)
    return out


def add_kimi_vllm_keys(out: Path) -> Path:
    """Add to a :func:`make_kimi_vlm_dir` directory the keys vLLM 0.32's K2.5 code reads
    and transformers' K2.5 classes do not write (checked against its ``kimi_k25.py`` and
    ``kimi_k25_vision_fused.py``): in ``config.json``, ``use_unified_vision_chunk`` (images
    as its ``vision_chunk`` modality; without it vLLM takes no image: "At most 0 image(s)")
    and ``media_placeholder_token_id``; in ``preprocessor_config.json``, ``media_proc_cfg``,
    the remote-code processor's settings, here the fixture's (14-pixel patches, 2x2 merge,
    at most :data:`KIMI_MAX_PATCHES` patches, :data:`KIMI_MAX_PATCHES_PER_SIDE` a side)."""
    config = json.loads((out / "config.json").read_text())
    config["use_unified_vision_chunk"] = True
    config["media_placeholder_token_id"] = config["image_token_id"]
    _write_json(out / "config.json", config)
    preprocessor = json.loads((out / "preprocessor_config.json").read_text())
    preprocessor["media_proc_cfg"] = {
        "patch_size": KIMI_PATCH_SIZE,
        "merge_kernel_size": KIMI_MERGE_SIZE,
        "in_patch_limit": KIMI_MAX_PATCHES,
        "patch_limit_on_one_side": KIMI_MAX_PATCHES_PER_SIDE,
        "fixed_output_tokens": None,
        "temporal_merge_kernel_size": 4,
        "image_mean": list(KIMI_IMAGE_MEAN),
        "image_std": list(KIMI_IMAGE_STD),
        "in_patch_limit_each_frame": None,
        "in_patch_limit_video": None,
    }
    _write_json(out / "preprocessor_config.json", preprocessor)
    return out


def kimi_grid(height: int, width: int) -> tuple[int, int]:
    """The patch grid (rows, columns) Kimi_K25ImageProcessor gives an image that needs no
    resize: each side padded up to a multiple of patch * merge (28)."""
    factor = KIMI_PATCH_SIZE * KIMI_MERGE_SIZE
    rows = math.ceil(height / factor) * KIMI_MERGE_SIZE
    cols = math.ceil(width / factor) * KIMI_MERGE_SIZE
    return rows, cols


def kimi_num_image_tokens(height: int, width: int) -> int:
    rows, cols = kimi_grid(height, width)
    return rows * cols // KIMI_MERGE_SIZE**2


def kimi_pixel_inputs(image: Image.Image) -> dict[str, torch.Tensor]:
    """``pixel_values`` [patches, 3, 14, 14] and ``image_grid_thw`` [[1, rows, cols]] as
    transformers' Kimi_K25ImageProcessor makes them, without torchvision.

    Only for images that processor does not resize (at most :data:`KIMI_MAX_PATCHES`
    patches, :data:`KIMI_MAX_PATCHES_PER_SIDE` per side): it then pads the uint8 image with
    zeros at the bottom and right to whole 28-pixel cells, rescales, normalizes (so padding
    reads -1), and cuts row-major 14x14 patches.
    """
    import numpy as np
    import torch

    rgb = np.asarray(image.convert("RGB"))
    height, width = rgb.shape[:2]
    if (
        max(height // KIMI_PATCH_SIZE, 1) * max(width // KIMI_PATCH_SIZE, 1) > KIMI_MAX_PATCHES
        or max(height, width) > KIMI_MAX_PATCHES_PER_SIDE * KIMI_PATCH_SIZE
    ):
        raise ValueError(f"a {width}x{height} image would be resized; use the real processor")
    rows, cols = kimi_grid(height, width)
    padded = np.zeros((rows * KIMI_PATCH_SIZE, cols * KIMI_PATCH_SIZE, 3), dtype=np.uint8)
    padded[:height, :width] = rgb
    pixels = torch.from_numpy(padded).permute(2, 0, 1).float() / 255
    mean = torch.tensor(KIMI_IMAGE_MEAN)[:, None, None]
    std = torch.tensor(KIMI_IMAGE_STD)[:, None, None]
    pixels = (pixels - mean) / std
    p = KIMI_PATCH_SIZE
    patches = pixels.reshape(3, rows, p, cols, p).permute(1, 3, 0, 2, 4).reshape(-1, 3, p, p)
    return {"pixel_values": patches, "image_grid_thw": torch.tensor([[1, rows, cols]])}
