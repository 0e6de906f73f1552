"""Hidden-state capture with SGLang (tensor/expert parallel targets), in-process.

Drives the offline ``sglang.Engine`` (sglang >= 0.5.23) as a capture-only engine:
``enable_return_aux_hidden_states`` with ``speculative_algorithm="EAGLE3"`` makes
the target capture the three aux layers without loading any draft, and each
request is a prefill of the whole conversation with ``max_new_tokens=1``. The
engine owns the TP/EP worker processes, NCCL and the KV pool.

SGLang returns the concatenated aux states in place of the final-norm state; the
final-norm state (``LogitsProcessorOutput.last_hidden_states``) is computed in
the same forward but not returned. A forward hook on the model's
``logits_processor`` (SGLang's stock ``forward_hooks`` server argument, run in
every worker) appends it, so one pass returns ``[P, 3H + H]`` rows per request.

Pitfalls handled (notes/sglang.md section 5.2): the radix cache is off and
chunked prefill is off, otherwise only part of a prompt would be computed; every
response is checked to hold exactly one row per input token and ``4 * H`` values
per row, and anything else raises :class:`SGLangCaptureError`.

sglang is imported only when an engine is started (the ``gpu`` extra installs it).
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .. import model_config
from ..errors import SGLangCaptureError
from ..target import check_remote_code
from ..torch_utils import TORCH_DTYPES
from .layers import AuxLayers, resolve_aux_layers

log = logging.getLogger(__name__)

# SGLang models whose set_eagle3_layers_to_capture adds +1 to explicit ids only when
# the first id is 1, and takes them as output_hidden_states indices otherwise
# (sglang 0.5.23 models/deepseek_v2.py, glm4_moe_lite.py; Kimi-K2.x runs through
# deepseek_v2). Every other model adds +1 always (models/llama.py and most others).
FIRST_ID_RULE_ARCHITECTURES = frozenset(
    {
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM",
        "KimiK25ForConditionalGeneration",
        "Glm4MoeLiteForCausalLM",
    }
)

HOOK_FACTORY = "eagle3data.hidden_states.sglang_capture:append_last_hidden_states_hook"

DEFAULT_OPTIONS: dict[str, Any] = {
    "tp_size": 1,
    "ep_size": 1,
    "mem_fraction_static": 0.8,
    "extra_args": {},
}


def sglang_layer_ids(aux: AuxLayers, architectures: Sequence[str]) -> list[int]:
    """Ids to pass as ``return_aux_hidden_state_layer_ids`` so SGLang captures
    exactly the outputs of ``aux.layer_ids`` (0-based decoder layers).

    SGLang captures the residual stream *entering* layer ``j`` and turns an explicit
    id into ``j`` per model (see FIRST_ID_RULE_ARCHITECTURES).
    """
    layer_output = list(aux.layer_ids)
    if not FIRST_ID_RULE_ARCHITECTURES.intersection(architectures):
        return layer_output  # j = id + 1
    if layer_output[0] == 1:
        return layer_output  # first id 1: j = id + 1
    indices = list(aux.hidden_states_indices)
    if indices[0] == 1:
        # Taken as-is it would be read as "first id 1" and shifted by one more.
        raise SGLangCaptureError(
            f"aux layer outputs {layer_output} cannot be requested from SGLang for "
            f"{list(architectures)}: its capture hook reads a first id of 1 as a layer "
            f"output and any other first id as an input index, so layer 0's output is "
            f"not expressible; use the transformers backend or other aux layers"
        )
    return indices  # j = id


def engine_kwargs(
    model_path: str,
    *,
    dtype: str,
    layer_ids: Sequence[int],
    options: Mapping[str, Any],
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """``sglang.Engine`` arguments (``ServerArgs`` field names) of a capture engine."""
    opts = {**DEFAULT_OPTIONS, **options}
    forced: dict[str, Any] = {
        "model_path": model_path,
        "dtype": dtype,
        "tp_size": int(opts["tp_size"]),
        "ep_size": int(opts["ep_size"]),
        "mem_fraction_static": float(opts["mem_fraction_static"]),
        # model.trust_remote_code: SGLang loads the tokenizer and config as we do.
        "trust_remote_code": bool(trust_remote_code),
        # A radix-cache hit computes (and returns) only the uncached suffix.
        "disable_radix_cache": True,
        # Chunked prefill keeps only the last chunk's rows.
        "chunked_prefill_size": -1,
        # Capture-only: "EAGLE3" names the capture convention; no draft is loaded.
        "enable_return_aux_hidden_states": True,
        "speculative_algorithm": "EAGLE3",
        "return_aux_hidden_state_layer_ids": list(layer_ids),
        "forward_hooks": [
            {
                "name": "eagle3data-last-hidden-states",
                "target_modules": ["logits_processor", "*.logits_processor"],
                "hook_factory": HOOK_FACTORY,
            }
        ],
        # Forward hooks run only on the eager path (a graph replay skips Python), and
        # capture requests are prefills only: no decode graph is worth its memory.
        "disable_prefill_cuda_graph": True,
        "disable_decode_cuda_graph": True,
        # We send token ids and read states; no detokenised text is needed.
        "skip_tokenizer_init": True,
    }
    extra = dict(opts.get("extra_args") or {})
    clash = sorted(set(extra) & set(forced))
    if clash:
        raise SGLangCaptureError(
            f"hidden_states.sglang.extra_args may not set {clash}: the capture sets them"
        )
    return {**forced, **extra}


def append_last_hidden_states_hook(_config: Mapping[str, Any]) -> Callable[..., None]:
    """Forward-hook factory SGLang calls in each worker (``forward_hooks``).

    Under full capture with aux states, ``output.hidden_states`` holds the aux rows
    and ``output.last_hidden_states`` the post-norm rows of the same tokens; the
    hook puts both into the returned rows as ``[aux | last]``.
    """

    def hook(_module: Any, _inputs: Any, output: Any) -> None:
        aux = getattr(output, "hidden_states", None)
        last = getattr(output, "last_hidden_states", None)
        if aux is None or last is None or aux.shape[0] != last.shape[0]:
            return
        output.hidden_states = torch.cat([aux, last.to(aux.dtype)], dim=-1)
        output.last_hidden_states = None

    return hook


def split_states(
    output: Mapping[str, Any], length: int, hidden_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [T, 3H], last [T, H]) from one ``Engine.generate`` result, checked."""
    meta = output.get("meta_info", {})
    blocks = meta.get("hidden_states")
    if not blocks:
        raise SGLangCaptureError(
            "SGLang returned no hidden states; the engine must run with "
            "enable_return_aux_hidden_states and the request with return_hidden_states"
        )
    prompt_tokens = meta.get("prompt_tokens", length)
    cached = meta.get("cached_tokens", 0) or 0
    rows = torch.tensor(blocks[0], dtype=torch.float32)
    if rows.ndim != 2 or rows.shape[0] != length or prompt_tokens != length or cached:
        raise SGLangCaptureError(
            f"SGLang returned {rows.shape[0] if rows.ndim else 0} hidden-state rows for "
            f"a {length}-token sample (prompt_tokens={prompt_tokens}, cached_tokens="
            f"{cached}); expected one row per token. A radix-cache hit or chunked "
            f"prefill computes only part of the prompt: run with disable_radix_cache "
            f"and chunked_prefill_size=-1"
        )
    width = rows.shape[1]
    if width != 4 * hidden_size:
        raise SGLangCaptureError(
            f"SGLang returned {width} values per token, expected 3 aux layers + the "
            f"final-norm state = {4 * hidden_size} (hidden_size {hidden_size}); is the "
            f"forward hook {HOOK_FACTORY} registered and does the model capture 3 layers?"
        )
    # float32 -> model dtype is exact: the values were the model dtype's own.
    rows = rows.to(dtype)
    return rows[:, : 3 * hidden_size].contiguous(), rows[:, 3 * hidden_size :].contiguous()


def start_engine(kwargs: Mapping[str, Any]) -> Any:
    """A real ``sglang.Engine`` (needs the ``gpu`` extra and CUDA GPUs)."""
    try:
        import sglang
    except ImportError as exc:
        raise SGLangCaptureError(
            "hidden_states.backend is sglang but sglang is not installed; "
            "install the gpu extra: pip install -e '.[gpu]'"
        ) from exc
    return sglang.Engine(**kwargs)


class SGLangCapture:
    """An :class:`~.backends.Extractor` on an ``sglang.Engine``."""

    def __init__(
        self,
        model_path: str,
        *,
        aux_layers: str | Sequence[int] = "auto",
        convention: str = "layer_output",
        dtype: str = "auto",
        options: Mapping[str, Any] | None = None,
        trust_remote_code: bool = False,
        engine_factory: Callable[[Mapping[str, Any]], Any] = start_engine,
    ) -> None:
        check_remote_code(model_path, trust_remote_code)
        config = model_config.read_model_config(model_path)
        depth = model_config.num_hidden_layers(config)
        self.aux: AuxLayers = resolve_aux_layers(aux_layers, depth, convention)
        self.hidden_size = model_config.hidden_size(config)
        dtype_name = model_config.resolve_dtype_name(dtype, config)
        self.dtype: torch.dtype = TORCH_DTYPES[dtype_name]
        self.engine_kwargs = engine_kwargs(
            model_path,
            dtype=dtype_name,
            layer_ids=sglang_layer_ids(self.aux, model_config.architectures(config)),
            options=options or {},
            trust_remote_code=trust_remote_code,
        )
        log.info(
            "starting sglang capture engine: tp_size=%d ep_size=%d aux layer outputs %s",
            self.engine_kwargs["tp_size"],
            self.engine_kwargs["ep_size"],
            list(self.aux.layer_ids),
        )
        self.engine = engine_factory(self.engine_kwargs)
        # The engine's worker processes must not outlive the job.
        atexit.register(self.close)

    def forward(self, samples: Sequence[Sequence[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(aux [T, 3H], last [T, H]) per sample, in the model dtype, on the CPU."""
        outputs = self.engine.generate(
            input_ids=[list(s) for s in samples],
            sampling_params={"max_new_tokens": 1, "temperature": 0.0},
            return_hidden_states=True,
        )
        if len(outputs) != len(samples):
            raise SGLangCaptureError(
                f"SGLang returned {len(outputs)} results for {len(samples)} samples"
            )
        return [
            split_states(out, len(s), self.hidden_size, self.dtype)
            for out, s in zip(outputs, samples, strict=True)
        ]

    def close(self) -> None:
        engine, self.engine = self.engine, None
        shutdown = getattr(engine, "shutdown", None)
        if shutdown is not None:
            shutdown()
