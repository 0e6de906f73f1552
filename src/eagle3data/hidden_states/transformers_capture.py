"""Hidden-state capture with transformers (in-process, CPU or GPU).

Forward hooks capture exactly the aux layers' outputs and the final norm's input
(``final_state: pre_norm``) or output (``post_norm``), and the forward runs the base
model only (no lm_head: a vocab-sized projection per token that nothing here uses).
Batches are right-padded, so the causal mask keeps real tokens from ever seeing padding;
padding rows are dropped before anything is stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..model_config import hidden_size, num_hidden_layers
from ..target import load_causal_lm
from .final_state import FINAL_STATES, PRE_NORM
from .layers import AuxLayers, resolve_aux_layers


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
        self.model, self.tokenizer = load_causal_lm(
            model_path, dtype=dtype, device=device, gpus=gpus, trust_remote_code=trust_remote_code
        )
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
        return {
            "engine": f"transformers {transformers.__version__}",
            "layout": device if device == "cpu" else f"{device} x{self._gpus}",
            "aux_layers_confirmed_by": "forward hooks on those decoder layers",
        }

    def _hook(self, name: str, *, norm_input: bool = False) -> Any:
        def capture(_module: Any, inputs: Any, output: Any) -> None:
            self._captured[name] = inputs[0] if norm_input else _tensor(output)

        return capture

    @torch.inference_mode()
    def forward(self, samples: Sequence[Sequence[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(aux [T, 3H], last [T, H]) per sample, in the model dtype, on the CPU."""
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
