"""The target's ``config.json``, read one way everywhere.

Multimodal wrappers (Kimi-K2.5's ``KimiK25ForConditionalGeneration``, LLaVA-style
models) keep the language model's sizes in a nested ``text_config``. That text decoder
is the model whose hidden states are captured, whose vocabulary the draft predicts and
whose context bounds a prompt, so every size here is the text decoder's: the value in
``text_config`` when there is one, else the top level's. When both levels name a value
and they differ, nothing guesses (a wrong width or depth would silently shift or
garble every stored state): :class:`ModelConfigError` says which keys disagree.

This module is the one place that knows that layout (:func:`is_wrapper`,
:func:`text_decoder_dict`, :func:`decoder_key_mapping` for the checkpoint's tensor names;
``target`` builds the decoder from them). Accepts the parsed JSON,
a transformers ``PretrainedConfig`` or a namespace. No transformers import: planning jobs and
the dry run stay cheap.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .checks import positive_int
from .errors import ModelConfigError

DTYPES = ("bfloat16", "float16", "float32")

# Checkpoint names of a wrapper's text decoder -> the decoder's own names: the original
# Kimi-K2.5 / LLaVA layout, and the layout transformers itself saves wrappers in.
WRAPPER_KEY_MAPPING = {
    r"^language_model\.model\.": "model.",
    r"^language_model\.lm_head\.": "lm_head.",
    r"^model\.language_model\.": "model.",
}


def read_model_config(model_path: str | Path) -> dict[str, Any]:
    """``config.json`` of a local model directory, as a dict."""
    return json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))


def hidden_size(config: Any) -> int:
    return _positive(config, "hidden_size")


def num_hidden_layers(config: Any) -> int:
    """Decoder depth: the count the EAGLE-3 aux-layer rule is applied to."""
    return _positive(config, "num_hidden_layers")


def vocab_size(config: Any) -> int:
    """Rows of the target's lm_head: the ids a draft vocabulary is chosen from."""
    return _positive(config, "vocab_size")


def context_length(config: Any) -> int | None:
    """``max_position_embeddings`` of the text decoder, or None when it declares none."""
    value = _text_decoder_value(config, "max_position_embeddings")
    return (
        None if value is None else positive_int(value, "max_position_embeddings", ModelConfigError)
    )


def architectures(config: Any) -> list[str]:
    """The checkpoint's model classes: the wrapper's and its text decoder's, in that order
    (SGLang picks its implementation, and so its layer numbering, by these names)."""
    top, text = _levels(config)
    names: list[str] = []
    for level in (top, text or {}):
        for name in level.get("architectures") or []:
            if name not in names:
                names.append(str(name))
    return names


def eos_token_ids(config: Any) -> set[int]:
    """Every ``eos_token_id`` the config names (int or list), at the top level and in
    ``text_config``: a generation config's and a wrapper's may each add their own."""
    ids: set[int] = set()
    for level in _levels(config):
        value = (level or {}).get("eos_token_id")
        ids.update([value] if isinstance(value, int) else value or [])
    return ids


def declared_dtype(config: Any) -> str:
    """The dtype a checkpoint declares (``dtype`` or the older ``torch_dtype``); float32 if
    it declares none. The top level declares it for the whole checkpoint; a wrapper that
    does not is read from its ``text_config``."""
    top, text = _levels(config)
    for level in (top, text or {}):
        for key in ("dtype", "torch_dtype"):
            value = level.get(key)
            if value in DTYPES:
                return str(value)
    return "float32"


# Where image-text models name the token an image placeholder expands to: Qwen-VL and
# transformers' Kimi-K2.5 ``image_token_id``, LLaVA ``image_token_index``, K2.5's own
# config.json ``media_placeholder_token_id``.
_IMAGE_TOKEN_KEYS = ("image_token_id", "image_token_index", "media_placeholder_token_id")


def image_token_id(config: Any) -> int | None:
    """The id each image's tokens carry in the expanded input ids; None: a text model."""
    top, _ = _levels(config)
    for key in _IMAGE_TOKEN_KEYS:
        value = top.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def is_wrapper(config: Any) -> bool:
    """A multimodal wrapper: the text decoder's config is nested in ``text_config``."""
    return _levels(config)[1] is not None


def text_decoder_dict(config: Any) -> dict[str, Any]:
    """The text decoder's own config as a plain dict (a copy): a wrapper's ``text_config``,
    else the whole config."""
    top, text = _levels(config)
    return dict(top if text is None else text)


def decoder_key_mapping(config: Any) -> dict[str, str]:
    """Regex -> replacement from the checkpoint's tensor names to the text decoder's own
    (``model.norm.weight``...): :data:`WRAPPER_KEY_MAPPING` for a wrapper, else none (a
    plain checkpoint already uses the decoder's names). transformers' ``key_mapping``."""
    return dict(WRAPPER_KEY_MAPPING) if is_wrapper(config) else {}


def decoder_tensor_name(stored: str, mapping: Mapping[str, str]) -> str:
    """The text decoder's name of the checkpoint tensor ``stored`` under ``mapping``
    (:func:`decoder_key_mapping`)."""
    for pattern, replacement in mapping.items():
        stored = re.sub(pattern, replacement, stored)
    return stored


def rms_norm_eps(config: Any) -> float | None:
    """The text decoder's ``rms_norm_eps``, or None when it declares none."""
    value = _text_decoder_value(config, "rms_norm_eps")
    return None if value is None else float(value)


def resolve_dtype_name(requested: str, config: Any) -> str:
    """``auto`` means the dtype the checkpoint declares."""
    return declared_dtype(config) if requested == "auto" else requested


def weights_quantization(config: Any) -> str:
    """How the checkpoint's weights are quantized, as its ``quantization_config`` names it
    (``fp8``, ``compressed-tensors``, ...; a wrapper's text decoder's too), or ``none``."""
    quant = _text_decoder_value(config, "quantization_config")
    if not isinstance(quant, Mapping):
        return "none"
    method = quant.get("quant_method") or quant.get("format") or "unnamed"
    return str(method)


def _positive(config: Any, key: str) -> int:
    value = _text_decoder_value(config, key)
    if value is None:
        raise ModelConfigError(f"model config has no {key} (nor text_config.{key})")
    return positive_int(value, key, ModelConfigError)


def _text_decoder_value(config: Any, key: str) -> Any:
    top, text = _levels(config)
    top_value = top.get(key)
    text_value = None if text is None else text.get(key)
    if top_value is not None and text_value is not None and top_value != text_value:
        raise ModelConfigError(
            f"model config has {key}={top_value} but text_config.{key}={text_value}; "
            f"cannot tell which decoder is meant"
        )
    return text_value if text_value is not None else top_value


def _levels(config: Any) -> tuple[Mapping[str, Any], Mapping[str, Any] | None]:
    """(top level, ``text_config`` or None): the one reading of a wrapper's layout."""
    top = _as_mapping(config, "model config")
    text = top.get("text_config")
    return top, None if text is None else _as_mapping(text, "model config's text_config")


def _as_mapping(config: Any, what: str) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        return config
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):  # a transformers config: plain values, dtype as its name
        return to_dict()  # type: ignore[no-any-return]
    try:
        return vars(config)  # a namespace
    except TypeError:
        raise ModelConfigError(f"{what} is a {type(config).__name__}, not an object") from None
