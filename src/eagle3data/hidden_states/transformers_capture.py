"""Hidden-state capture with transformers (in-process, CPU or GPU).

Forward hooks capture exactly the aux layers' outputs and the final norm's input
(``final_state: pre_norm``) or output (``post_norm``), and the forward runs the base
model only (no lm_head: a vocab-sized projection per token that nothing here uses).
Batches are right-padded, so the causal mask keeps real tokens from ever seeing padding;
padding rows are dropped before anything is stored.

An image-text target (:func:`..target.is_image_text_model`) is loaded whole, vision tower
included, with its processor: a sample with images runs alone through the base model with
its pixels (the target's image processor on the images its tokens hold), so every text
position after an image sees it, as when the target generated; the hooks on the text
decoder capture as for text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ValidationError
from ..model_config import hidden_size, image_token_id, num_hidden_layers, read_model_config
from ..target import is_image_text_model, load_causal_lm, load_image_text_model
from .final_state import FINAL_STATES, PRE_NORM
from .layers import AuxLayers, resolve_aux_layers

if TYPE_CHECKING:
    from PIL.Image import Image


def _tensor(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


class HiddenStateExtractor:
    """An :class:`~.backends.Extractor` on a transformers model loaded in this process."""

    def __init__(
        self,
        model_path: str,
        *,
        aux_layers: str | Sequence[int] = "auto",
        convention: str = "layer_output",
        dtype: str = "auto",
        device: str = "auto",
        gpus: int = 1,
        trust_remote_code: bool = False,
        final_state: str = PRE_NORM,
    ) -> None:
        if final_state not in FINAL_STATES:
            raise ValueError(f"final_state must be one of {list(FINAL_STATES)}: {final_state!r}")
        self.final_state = final_state
        self._gpus = gpus
        self.processor: Any = None  # an image-text target's: its image processor
        self.image_token = image_token_id(read_model_config(model_path))
        load = dict(dtype=dtype, device=device, gpus=gpus, trust_remote_code=trust_remote_code)
        if is_image_text_model(model_path):
            self.model, self.processor = load_image_text_model(model_path, **load)
            self.tokenizer = self.processor.tokenizer
        else:
            self.model, self.tokenizer = load_causal_lm(model_path, **load)
        self.base = self.model.get_decoder()
        self.aux: AuxLayers = resolve_aux_layers(
            aux_layers, num_hidden_layers(self.model.config), convention
        )
        self.hidden_size = hidden_size(self.model.config)
        self.dtype: torch.dtype = next(self.model.parameters()).dtype
        self._captured: dict[str, torch.Tensor] = {}
        layers = self.base.layers
        for k in self.aux.layer_ids:
            layers[k].register_forward_hook(self._hook(f"aux{k}"))
        pre_norm = final_state == PRE_NORM
        self.base.norm.register_forward_hook(self._hook("final", norm_input=pre_norm))

    def capture_fingerprint(self) -> dict[str, Any]:
        """The engine's part of the shards' fingerprint (:mod:`.fingerprint`)."""
        import transformers

        device = self.model.device.type
        engine = f"transformers {transformers.__version__}"
        if self.processor is not None:
            # Its pixels are what the states after an image saw, and the PIL and torchvision
            # processors of one checkpoint resize differently (Qwen2-VL: up to 0.27 apart).
            engine += f" (image processor {type(self.processor.image_processor).__name__})"
        return {
            "engine": engine,
            "layout": device if device == "cpu" else f"{device} x{self._gpus}",
            "aux_layers_confirmed_by": "forward hooks on those decoder layers",
        }

    def _hook(self, name: str, *, norm_input: bool = False) -> Any:
        def capture(_module: Any, inputs: Any, output: Any) -> None:
            self._captured[name] = inputs[0] if norm_input else _tensor(output)

        return capture

    @torch.inference_mode()
    def forward(
        self,
        samples: Sequence[Sequence[int]],
        images: Sequence[Sequence[Image]] | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(aux [T, 3H], last [T, H]) per sample, in the model dtype, on the CPU;
        ``images``: each sample's images, in the order its tokens hold them."""
        if images is None or not any(images):
            return self._forward_text(samples)
        text = [k for k, pictures in enumerate(images) if not pictures]
        states = {}
        if text:
            computed = self._forward_text([samples[k] for k in text])
            states = dict(zip(text, computed, strict=True))
        for k, pictures in enumerate(images):
            if pictures:
                states[k] = self._forward_images(samples[k], pictures)
        return [states[k] for k in range(len(samples))]

    def _forward_images(
        self, sample: Sequence[int], images: Sequence[Image]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sample with its images, alone: pixels do not pad."""
        if self.processor is None or self.image_token is None:
            raise ValidationError(
                "a sample with images, but the target is not an image-text model (its "
                "config names no image token, or its directory has no preprocessor_config.json)"
            )
        ids = torch.tensor([list(sample)], dtype=torch.long)
        inputs: dict[str, torch.Tensor] = {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            **self.processor.image_processor(images=list(images), return_tensors="pt"),
        }
        if "mm_token_type_ids" in self.processor.model_input_names:  # Qwen-VL's 3-D positions
            inputs["mm_token_type_ids"] = (ids == self.image_token).long()
        device = self.model.device
        inputs = {
            k: v.to(device, self.dtype) if v.is_floating_point() else v.to(device)
            for k, v in inputs.items()
        }
        self._captured.clear()
        try:
            self.model.model(**inputs, use_cache=False)
        except ValueError as exc:  # e.g. image tokens and image features in other numbers
            raise ValidationError(
                f"the target refused a sample with {len(images)} image(s) and "
                f"{int((ids == self.image_token).sum())} image tokens: {exc}"
            ) from None
        aux = torch.cat([self._captured[f"aux{k}"].cpu() for k in self.aux.layer_ids], dim=-1)
        return aux[0], self._captured["final"].cpu()[0]

    def _forward_text(
        self, samples: Sequence[Sequence[int]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        width = max(len(s) for s in samples)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(samples), width), pad, dtype=torch.long)
        mask = torch.zeros((len(samples), width), dtype=torch.long)
        for row, s in enumerate(samples):
            ids[row, : len(s)] = torch.tensor(list(s), dtype=torch.long)
            mask[row, : len(s)] = 1
        device = self.model.device
        self._captured.clear()
        self.base(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
        # .cpu() before cat: with device_map="auto" the layers live on different GPUs.
        aux = torch.cat([self._captured[f"aux{k}"].cpu() for k in self.aux.layer_ids], dim=-1)
        last = self._captured["final"].cpu()
        return [(aux[row, : len(s)], last[row, : len(s)]) for row, s in enumerate(samples)]
