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
every worker) joins them into ``[P, 3H + H]`` rows per request, and then, by
``hidden_states.sglang.handoff``, hands them over (below). With ``final_state:
pre_norm`` a second hook, on the decoder's final norm, keeps the norm's input (the
updated residual its fused add-and-norm returns) and the rows carry that in place of
the post-norm state.

* ``shared_memory`` (default): the hook copies the forward batch's rows into shared
  memory and SGLang returns only a ``[P, 3]`` pointer per request (:mod:`.handoff`):
  the states stay tensors from the GPU to the shard writer;
* ``lists``: SGLang returns the rows themselves, as Python float lists through its
  scheduler and tokenizer manager (~120 tokens/s of host work at Kimi's width; kept as
  a fallback and for comparison).

Pitfalls handled (notes/sglang.md section 5.2): the radix cache is off and
chunked prefill is off, otherwise only part of a prompt would be computed; every
response is checked to hold exactly one row per input token and ``4 * H`` values
per row, and anything else raises :class:`SGLangCaptureError`.

The hooks and the reading of their rows are :mod:`.sglang_hooks`; how the engine's worker
processes are started, signalled and logged, :mod:`.sglang_engine`.

sglang is imported only when an engine is started (the ``gpu`` extra installs it).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .. import model_config
from ..errors import SGLangCaptureError
from ..schema import schema_defaults
from ..servers.processes import EngineWatch, descendants, process_keys, shm_files
from ..servers.reaper import Reaper
from ..target import check_remote_code
from ..torch_utils import TORCH_DTYPES
from . import handoff, sglang_engine
from .engine_target import read_engine_target
from .final_state import PRE_NORM
from .layers import AuxLayers
from .sglang_engine import drop_messaging_contexts, job_log_path, start_engine
from .sglang_hooks import (
    FINAL_NORM_MODULES,
    HOOK_FACTORY,
    PRE_NORM_HOOK_FACTORY,
    SHARED_HOOK_FACTORY,
    split_states,
)

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

HANDOFFS = ("shared_memory", "lists")


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
    handoff_dir: str | None = None,
    device: str = "auto",
    final_state: str = PRE_NORM,
) -> dict[str, Any]:
    """``sglang.Engine`` arguments (``ServerArgs`` field names) of a capture engine;
    with ``handoff_dir`` the hook hands rows over through shared memory there;
    ``device`` other than ``auto`` is SGLang's ``device`` (``cpu``: its CPU engine);
    ``final_state`` is the final state the rows carry."""
    # The config's section holds every default; given by hand, the schema's fill it.
    opts = {**schema_defaults("hidden_states", "sglang"), **options}
    if handoff_dir is None:
        hook = {"hook_factory": HOOK_FACTORY, "config": {"final_state": final_state}}
    else:
        hook = {
            "hook_factory": SHARED_HOOK_FACTORY,
            "config": {"directory": handoff_dir, "final_state": final_state},
        }
    hooks = [
        {
            "name": "eagle3data-last-hidden-states",
            "target_modules": ["logits_processor", "*.logits_processor"],
            **hook,
        }
    ]
    if final_state == PRE_NORM:
        hooks.insert(
            0,
            {
                "name": "eagle3data-pre-norm",
                "target_modules": FINAL_NORM_MODULES,
                "hook_factory": PRE_NORM_HOOK_FACTORY,
            },
        )
    forced: dict[str, Any] = {
        "model_path": model_path,
        "dtype": dtype,
        "tp_size": int(opts["tp_size"]),
        "ep_size": int(opts["ep_size"]),
        "dp_size": int(opts["dp_size"]),
        "enable_dp_attention": bool(opts["enable_dp_attention"]),
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
        "forward_hooks": hooks,
        # Forward hooks run only on the eager path (a graph replay skips Python), and
        # capture requests are prefills only: no decode graph is worth its memory.
        "disable_prefill_cuda_graph": True,
        "disable_decode_cuda_graph": True,
        # We send token ids and read states; no detokenised text is needed.
        "skip_tokenizer_init": True,
    }
    if device != "auto":
        forced["device"] = device.split(":", 1)[0]  # SGLang places ranks itself
    extra = dict(opts.get("extra_args") or {})
    clash = sorted(set(extra) & set(forced))
    if clash:
        raise SGLangCaptureError(
            f"hidden_states.sglang.extra_args may not set {clash}: the capture sets them"
        )
    return {**forced, **extra}


class SGLangCapture:
    """An :class:`~.backends.Extractor` on an ``sglang.Engine``."""

    def capture_fingerprint(self) -> dict[str, Any]:
        """The engine's part of the shards' fingerprint (:mod:`.fingerprint`): the parallel
        layout the engine was started with (not the GPUs' placement, which changes
        nothing in the states)."""
        from importlib.metadata import PackageNotFoundError, version

        try:
            engine = f"sglang {version('sglang')}"
        except PackageNotFoundError:  # a stand-in engine (the unit tests)
            engine = "sglang (not installed here)"
        kw = self.engine_kwargs
        layout = f"tp {kw['tp_size']}, dp {kw['dp_size']}, ep {kw['ep_size']}"
        if kw["enable_dp_attention"]:
            layout += " (dp attention)"
        if kw.get("device") == "cpu":
            layout += ", cpu"
        fingerprint = {
            "engine": engine,
            "layout": layout,
            "aux_layers_confirmed_by": "SGLang's capture of the layers asked for (rows "
            "of 4 x the hidden size checked)",
        }
        if kw.get("quantization"):
            fingerprint["weights_quantization"] = f"{kw['quantization']} (by SGLang)"
        return fingerprint

    def __init__(
        self,
        model_path: str,
        *,
        aux_layers: str | Sequence[int] = "auto",
        convention: str = "layer_output",
        dtype: str = "auto",
        options: Mapping[str, Any] | None = None,
        trust_remote_code: bool = False,
        batch_tokens: int | None = None,
        device: str = "auto",
        engine_factory: Callable[[Mapping[str, Any]], Any] = start_engine,
        final_state: str = PRE_NORM,
    ) -> None:
        check_remote_code(model_path, trust_remote_code)
        target = read_engine_target(
            model_path,
            aux_layers=aux_layers,
            convention=convention,
            dtype=dtype,
            final_state=final_state,
            error=SGLangCaptureError,
        )
        self.final_state = final_state
        opts = {**schema_defaults("hidden_states", "sglang"), **(options or {})}
        if opts["handoff"] not in HANDOFFS:
            raise SGLangCaptureError(
                f"hidden_states.sglang.handoff must be one of {list(HANDOFFS)}, "
                f"got {opts['handoff']!r}"
            )
        config = target.config
        self.aux: AuxLayers = target.aux
        self.hidden_size = target.hidden_size
        dtype_name = target.dtype_name
        self.dtype: torch.dtype = TORCH_DTYPES[dtype_name]
        self.engine: Any = None
        self.reader: handoff.RowsReader | None = None
        self._reaper: Reaper | None = None
        self._watch: EngineWatch | None = None
        self._reported_at = 0.0
        self._report_after_batch = True  # workers map some shared memory at their first batch
        # The engine's worker processes and the hand-off memory must not outlive the job
        # (at exit the logging streams may be gone: no summary then).
        atexit.register(self.close, summary=False)
        # First, so that whatever follows is cleaned up even after a kill -9 of this job.
        self._reaper = Reaper(job_log_path())
        if opts["handoff"] == "shared_memory":
            directory = handoff.make_dir(opts["handoff_dir"])
            self.reader = handoff.RowsReader(directory, 4 * self.hidden_size, self.dtype)
            self._reaper.watch(dirs=[str(directory)])
            if batch_tokens:
                # One batch being written to the shard while the next one arrives.
                need = 2 * handoff.rows_nbytes(batch_tokens, 4 * self.hidden_size, self.dtype)
                self._check_room(need, "two batches of hidden_states.batch_tokens")
        self.engine_kwargs = engine_kwargs(
            model_path,
            dtype=dtype_name,
            layer_ids=sglang_layer_ids(self.aux, model_config.architectures(config)),
            options=opts,
            trust_remote_code=trust_remote_code,
            handoff_dir=None if self.reader is None else str(self.reader.directory),
            device=device,
            final_state=final_state,
        )
        log.info(
            "starting sglang capture engine: tp_size=%d ep_size=%d dp_size=%d%s, aux layer "
            "outputs %s, states handed over as %s",
            self.engine_kwargs["tp_size"],
            self.engine_kwargs["ep_size"],
            self.engine_kwargs["dp_size"],
            " (data-parallel attention)" if self.engine_kwargs["enable_dp_attention"] else "",
            list(self.aux.layer_ids),
            opts["handoff"],
        )
        sglang_engine.before_engine = process_keys(descendants(os.getpid()))
        self._own_files = shm_files([os.getpid()])
        try:
            self.engine = engine_factory(self.engine_kwargs)
        except BaseException:
            self.close()
            drop_messaging_contexts()
            raise
        self._watch = sglang_engine.engine_watch = EngineWatch(sglang_engine.before_engine)
        self._report_to_reaper()

    def _report_to_reaper(self) -> None:
        """Tell the reaper which processes the engine runs and which shared memory they
        (and this job, since the engine started) hold."""
        if self._reaper is None or self._watch is None:
            return
        self._watch.refresh()
        skip = () if self.reader is None else (f"{self.reader.directory}/",)
        files = shm_files(self._watch.running_pids()) | (shm_files([os.getpid()]) - self._own_files)
        self._reaper.watch(
            workers=[(w.pid, w.started) for w in self._watch.workers],
            files=[f for f in files if not f.startswith(skip)],
        )
        self._reported_at = time.monotonic()

    def _check_room(self, needed: int, what: str) -> None:
        if self.reader is not None:
            try:
                handoff.check_room(self.reader.directory, needed, what)
            except SGLangCaptureError:
                self.close()
                raise

    def forward(self, samples: Sequence[Sequence[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(aux [T, 3H], last [T, H]) per sample, in the model dtype, on the CPU (with
        the shared-memory hand-off: views of the mapped rows, valid until dropped)."""
        if self.reader is not None:
            tokens = sum(len(s) for s in samples)
            self._check_room(
                handoff.rows_nbytes(tokens, 4 * self.hidden_size, self.dtype),
                f"a batch of {tokens} tokens",
            )
        try:
            outputs = self.engine.generate(
                input_ids=[list(s) for s in samples],
                sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                return_hidden_states=True,
            )
        except Exception:
            if sglang_engine.worker_failure is not None:  # worker_failed stopped the engine's loop
                raise SGLangCaptureError(sglang_engine.worker_failure) from None
            raise
        if self._report_after_batch or time.monotonic() - self._reported_at > _REPORT_INTERVAL_S:
            self._report_to_reaper()
            self._report_after_batch = False
        if len(outputs) != len(samples):
            raise SGLangCaptureError(
                f"SGLang returned {len(outputs)} results for {len(samples)} samples"
            )
        try:
            return [
                split_states(out, len(s), self.hidden_size, self.dtype, self.reader)
                for out, s in zip(outputs, samples, strict=True)
            ]
        finally:
            if self.reader is not None:
                self.reader.release()

    def end_shard(self) -> None:
        """Log which ranks wrote this shard's rows, and count the next shard's afresh."""
        if self.reader is not None and self.reader.writers:
            log.info("sglang hand-off: %s", self.reader.summary())
            self.reader.writers.clear()

    def close(self, *, summary: bool = True) -> None:
        """Stop the engine and remove what it leaves: its processes, its shared memory and
        the hand-off directory (:mod:`eagle3data.servers.reaper`); log which ranks wrote the rows.
        Safe to call more than once."""
        engine, self.engine = self.engine, None
        if engine is not None:
            self._report_to_reaper()
        shutdown = getattr(engine, "shutdown", None)
        if shutdown is not None:
            shutdown()
        reader, self.reader = self.reader, None
        if reader is not None:
            if reader.writers and summary:
                log.info("sglang hand-off: %s", reader.summary())
            shutil.rmtree(reader.directory, ignore_errors=True)
        reaper, self._reaper = self._reaper, None
        if reaper is not None and not reaper.finish() and summary:
            log.warning("the SGLang engine's clean-up did not answer in time")


# Between reports of the engine's shared memory to the reaper (the first batch always).
_REPORT_INTERVAL_S = 60.0
