"""The target model's files loaded one way everywhere: tokenizer, config, text decoder.

Two shapes of real targets shape this module:

* **Remote code.** Kimi-K2/K2.5 ship a slow tiktoken tokenizer as Python code
  (``tokenizer_config.json`` ``auto_map``) and no ``tokenizer.json``. Loaded without
  ``trust_remote_code``, transformers may *convert* ``tiktoken.model`` into a fast
  tokenizer with a generic split pattern: it loads, and it writes different ids from
  the target's own. A draft trained on those ids learns text the target never sees, so
  a directory that declares remote code is never loaded without it: the load stops
  and names ``model.trust_remote_code``. Every load (generation, tokenize, token
  counting, extraction; SGLang gets the same flag) goes through here.
* **Multimodal wrappers.** Kimi-K2.5 is ``KimiK25ForConditionalGeneration`` with the
  DeepSeek-V3 decoder in ``text_config`` and weights named ``language_model.*``.
  ``AutoModelForCausalLM`` refuses the wrapper's config, and the vision tower is dead
  weight for text, so :func:`load_causal_lm` builds the text decoder from
  ``text_config`` and maps the checkpoint's names onto it (transformers' own
  ``key_mapping``). A weight of the decoder missing from the checkpoint is an error,
  never a silently random layer. Image prompts need the whole model, vision tower
  included, and its processor (:func:`load_image_text_model`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import ModelConfigError
from .model_config import decoder_key_mapping, is_wrapper, read_model_config, text_decoder_dict

TRUST_KEY = "model.trust_remote_code"


def remote_code_files(model_path: str | Path) -> list[str]:
    """What in a model directory declares custom code (``auto_map`` entries)."""
    root = Path(model_path)
    found: list[str] = []
    for name in ("tokenizer_config.json", "config.json"):
        f = root / name
        if not f.is_file():
            continue
        try:
            auto_map = json.loads(f.read_text(encoding="utf-8")).get("auto_map") or {}
        except (ValueError, AttributeError) as exc:
            raise ModelConfigError(f"{f}: not a JSON object: {exc}") from exc
        found.extend(f"{name} auto_map.{key}" for key in sorted(auto_map))
    return found


def check_remote_code(model_path: str | Path, trust_remote_code: bool) -> None:
    """Refuse to load a directory that declares custom code unless it is trusted."""
    if trust_remote_code:
        return
    declared = remote_code_files(model_path)
    if declared:
        raise ModelConfigError(
            f"{model_path} declares custom code ({', '.join(declared)}); loading it "
            f"without that code would use a stand-in (a converted tokenizer writes other "
            f"token ids than the target's own). Set {TRUST_KEY}: true if you trust it"
        )


def load_tokenizer(model_path: str | Path, *, trust_remote_code: bool) -> Any:
    """The target's own tokenizer (slow, remote-code tokenizers included)."""
    from transformers import AutoTokenizer

    check_remote_code(model_path, trust_remote_code)
    return AutoTokenizer.from_pretrained(
        model_path, local_files_only=True, trust_remote_code=trust_remote_code
    )


def text_decoder_config(model_path: str | Path, *, trust_remote_code: bool) -> Any:
    """The transformers config of the text decoder (a wrapper's ``text_config``)."""
    from transformers import CONFIG_MAPPING, AutoConfig

    check_remote_code(model_path, trust_remote_code)
    raw = read_model_config(model_path)
    if not is_wrapper(raw):
        return AutoConfig.from_pretrained(
            model_path, local_files_only=True, trust_remote_code=trust_remote_code
        )
    text = text_decoder_dict(raw)
    model_type = text.pop("model_type", None)
    # Kimi-K2.5's own files name its DeepSeek-V3 decoder "kimi_k2" (transformers maps it).
    model_type = "deepseek_v3" if model_type == "kimi_k2" else model_type
    if model_type not in CONFIG_MAPPING:
        raise ModelConfigError(
            f"{model_path}/config.json: text_config.model_type {model_type!r} is not a "
            f"text decoder this transformers version knows"
        )
    return CONFIG_MAPPING[model_type](**text)


def load_causal_lm(
    model_path: str | Path,
    *,
    dtype: str,
    device: str,
    trust_remote_code: bool,
    gpus: int = 1,
) -> tuple[Any, Any]:
    """Load (text decoder, tokenizer) from a local directory, eval mode, no hub access.

    ``gpus > 1`` spreads the layers over every visible GPU (``device_map="auto"``,
    accelerate), for a target larger than one GPU; the GPU slot lock has already
    made only this job's GPUs visible.
    """
    from transformers import AutoModelForCausalLM

    from .torch_utils import resolve_device, resolve_dtype

    config = text_decoder_config(model_path, trust_remote_code=trust_remote_code)
    raw = read_model_config(model_path)
    wrapper = is_wrapper(raw)
    kwargs: dict[str, Any] = {
        "config": config,
        "dtype": resolve_dtype(dtype, raw),
        "local_files_only": True,
        "trust_remote_code": trust_remote_code,
        "output_loading_info": True,
    }
    if wrapper:
        kwargs["key_mapping"] = decoder_key_mapping(raw)
    multi_gpu = gpus > 1 and resolve_device(device).type == "cuda"
    if multi_gpu:
        kwargs["device_map"] = "auto"
    loaded = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    what = "wrapper text decoder" if wrapper else "model"
    model = _placed(loaded, model_path, what, device=device, spread=multi_gpu)
    return model, load_tokenizer(model_path, trust_remote_code=trust_remote_code)


def _placed(
    loaded: tuple[Any, Any], model_path: str | Path, what: str, *, device: str, spread: bool
) -> Any:
    """A ``from_pretrained(..., output_loading_info=True)`` result checked for weights the
    checkpoint lacks, on ``device`` (unless ``spread`` over GPUs already), in eval mode."""
    from .torch_utils import resolve_device

    model, info = loaded
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise ModelConfigError(
            f"{model_path}: {len(missing)} weight(s) of the {what} are not in the checkpoint "
            f"(e.g. {missing[:3]}); refusing to run with randomly initialised layers"
        )
    if not spread:
        model.to(resolve_device(device))
    return model.eval()


def is_image_text_model(model_path: str | Path) -> bool:
    """A target that reads images: its config names an image token and its directory has
    an image processor (a text-only export of a VLM has neither)."""
    from .model_config import image_token_id

    config = read_model_config(model_path)
    return image_token_id(config) is not None and (
        Path(model_path, "preprocessor_config.json").is_file()
    )


def load_image_text_model(
    model_path: str | Path,
    *,
    dtype: str,
    device: str,
    trust_remote_code: bool,
    gpus: int = 1,
) -> tuple[Any, Any]:
    """Load (the whole image-text model, its processor) for image prompts, eval mode.

    The processor is the model's own (``AutoProcessor``: remote code where the directory
    ships it): it expands each image placeholder to the image's tokens exactly as SGLang
    and vLLM do, since they run the same processor.
    """
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from .torch_utils import resolve_device, resolve_dtype

    raw = read_model_config(model_path)
    try:
        processor = AutoProcessor.from_pretrained(
            model_path, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except ImportError as exc:  # e.g. a processor that needs torchvision
        raise ModelConfigError(
            f"{model_path}: the target's processor does not load here ({exc}); an image-text "
            "target runs with it (install what the error names)"
        ) from None
    if not hasattr(processor, "image_processor"):
        raise ModelConfigError(
            f"{model_path}: the target's processor ({type(processor).__name__}) reads no "
            "images: is it an image-text model?"
        )
    multi_gpu = gpus > 1 and resolve_device(device).type == "cuda"
    loaded = AutoModelForImageTextToText.from_pretrained(
        model_path,
        dtype=resolve_dtype(dtype, raw),
        local_files_only=True,
        trust_remote_code=trust_remote_code,
        output_loading_info=True,
        **({"device_map": "auto"} if multi_gpu else {}),
    )
    model = _placed(loaded, model_path, "image-text model", device=device, spread=multi_gpu)
    return model, processor
