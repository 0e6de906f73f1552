"""Hidden-state extraction with transformers (in-process, CPU or GPU).

Forward hooks capture exactly the aux layers' outputs and the final norm's
output, and the forward runs the base model only (no lm_head: a vocab-sized
projection per token that nothing here uses). Batches are right-padded, so the
causal mask keeps real tokens from ever seeing padding; padding rows are
dropped before anything is stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .layers import AuxLayers, num_hidden_layers, resolve_aux_layers
from .torch_utils import load_causal_lm


def _tensor(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def length_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Group sample indices, longest first, so padded tokens per batch stay
    within ``batch_tokens`` (a longer sample gets a batch of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        # Sorted descending: the first member sets the padded width.
        if batches and lengths[batches[-1][0]] * (len(batches[-1]) + 1) <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


class HiddenStateExtractor:
    def __init__(
        self,
        model_path: str,
        *,
        aux_layers: str | Sequence[int] = "auto",
        convention: str = "layer_output",
        dtype: str = "auto",
        device: str = "auto",
    ) -> None:
        self.model, self.tokenizer = load_causal_lm(model_path, dtype=dtype, device=device)
        self.base = self.model.get_decoder()
        self.aux: AuxLayers = resolve_aux_layers(
            aux_layers, num_hidden_layers(self.model.config), convention
        )
        self.hidden_size = int(self.model.config.hidden_size)
        self.dtype: torch.dtype = next(self.model.parameters()).dtype
        self._captured: dict[str, torch.Tensor] = {}
        layers = self.base.layers
        for k in self.aux.layer_ids:
            layers[k].register_forward_hook(self._hook(f"aux{k}"))
        self.base.norm.register_forward_hook(self._hook("final_norm"))

    def _hook(self, name: str) -> Any:
        def capture(_module: Any, _inputs: Any, output: Any) -> None:
            self._captured[name] = _tensor(output)

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
        aux = torch.cat([self._captured[f"aux{k}"] for k in self.aux.layer_ids], dim=-1).cpu()
        last = self._captured["final_norm"].cpu()
        return [(aux[row, : len(s)], last[row, : len(s)]) for row, s in enumerate(samples)]
