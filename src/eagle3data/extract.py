"""Hidden-state extraction with transformers (in-process, CPU or GPU).

Forward hooks capture exactly the aux layers' outputs and the final norm's
output, and the forward runs the base model only (no lm_head: a vocab-sized
projection per token that nothing here uses). Batches are right-padded, so the
causal mask keeps real tokens from ever seeing padding; padding rows are
dropped before anything is stored.

:func:`extract_into_shard` is the loop the workflow runs: length-sorted batches
packed to a token budget, each batch's states written to their rows of the
shard by a background thread while the next batch is computed, so memory holds
about two batches, never a whole shard.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .layers import AuxLayers, num_hidden_layers, resolve_aux_layers
from .torch_utils import load_causal_lm

if TYPE_CHECKING:
    from .shards import ShardWriter


class Extractor(Protocol):
    """What the shard loop needs from a backend (transformers in-process, SGLang, ...)."""

    aux: AuxLayers
    hidden_size: int
    dtype: torch.dtype

    def forward(
        self, samples: Sequence[Sequence[int]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]: ...


def _tensor(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


# Padding is computed and thrown away. Once a batch holds this share of the token
# budget (enough to keep a GPU busy), a sample that would make more than
# _MAX_PADDING of it padding starts a new batch instead.
_MIN_FILL = 0.25
_MAX_PADDING = 0.1


def length_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Group sample indices, longest first, so padded tokens per batch stay
    within ``batch_tokens`` (a longer sample gets a batch of its own), and
    padding stays under 10% once a batch is a quarter full."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    real = 0  # real tokens in the last batch
    for i in order:
        if batches:
            # Sorted descending: the first member sets the padded width.
            padded = lengths[batches[-1][0]] * (len(batches[-1]) + 1)
            wasteful = real >= _MIN_FILL * batch_tokens and (
                padded - real - lengths[i] > _MAX_PADDING * padded
            )
            if padded <= batch_tokens and not wasteful:
                batches[-1].append(i)
                real += lengths[i]
                continue
        batches.append([i])
        real = lengths[i]
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
        gpus: int = 1,
    ) -> None:
        self.model, self.tokenizer = load_causal_lm(
            model_path, dtype=dtype, device=device, gpus=gpus
        )
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
        # .cpu() before cat: with device_map="auto" the layers live on different GPUs.
        aux = torch.cat([self._captured[f"aux{k}"].cpu() for k in self.aux.layer_ids], dim=-1)
        last = self._captured["final_norm"].cpu()
        return [(aux[row, : len(s)], last[row, : len(s)]) for row, s in enumerate(samples)]


# Batches whose states may wait for the writer thread: one being written while
# the next is computed. More only adds memory; the disk is not the bottleneck.
_WRITES_IN_FLIGHT = 1


def extract_into_shard(
    extractor: Extractor,
    writer: ShardWriter,
    sample_ids: Sequence[str],
    input_ids: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[int]],
    *,
    batch_tokens: int,
    background_writes: bool = True,
    on_batch: Callable[[int, int, int], None] | None = None,
) -> None:
    """Compute and store the hidden states of one shard's samples, in shard order.

    The samples are declared to ``writer`` first (ids, tokens, masks, offsets), then
    computed in length-sorted batches; each batch's rows go to their final offsets as
    soon as the batch is done. ``on_batch(n, of, samples_in_batch)`` reports progress.
    """
    writer.declare_samples(sample_ids, input_ids, loss_masks)
    batches = length_batches([len(x) for x in input_ids], batch_tokens)

    def write(batch: list[int], states: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for i, (aux, last) in zip(batch, states, strict=True):
            writer.write_states(i, aux, last)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer") as pool:
        pending: deque[Future[None]] = deque()
        for n, batch in enumerate(batches, start=1):
            states = extractor.forward([input_ids[i] for i in batch])
            if background_writes:
                pending.append(pool.submit(write, batch, states))
                while len(pending) > _WRITES_IN_FLIGHT:
                    pending.popleft().result()  # re-raises a failed write here
            else:
                write(batch, states)
            if on_batch is not None:
                on_batch(n, len(batches), len(batch))
        while pending:
            pending.popleft().result()
