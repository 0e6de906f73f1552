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

sglang is imported only when an engine is started (the ``gpu`` extra installs it).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from .. import model_config
from ..errors import SGLangCaptureError
from ..servers.processes import EngineWatch, descendants, process_keys, shm_files
from ..servers.reaper import Reaper
from ..target import check_remote_code
from ..torch_utils import TORCH_DTYPES
from . import handoff
from .engine_target import read_engine_target
from .final_state import PRE_NORM
from .layers import AuxLayers

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
SHARED_HOOK_FACTORY = "eagle3data.hidden_states.sglang_capture:shared_rows_hook"
PRE_NORM_HOOK_FACTORY = "eagle3data.hidden_states.sglang_capture:pre_norm_hook"
# The text decoder's final norm: model.norm (Llama, DeepSeek-V3), language_model.model.norm
# (Kimi-K2.5's wrapper).
FINAL_NORM_MODULES = ["model.norm", "*.model.norm"]
HANDOFFS = ("shared_memory", "lists")

DEFAULT_OPTIONS: dict[str, Any] = {
    "tp_size": 1,
    "ep_size": 1,
    "dp_size": 1,
    "enable_dp_attention": False,
    "mem_fraction_static": 0.8,
    "handoff": "shared_memory",
    "handoff_dir": "auto",
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
    handoff_dir: str | None = None,
    device: str = "auto",
    final_state: str = PRE_NORM,
) -> dict[str, Any]:
    """``sglang.Engine`` arguments (``ServerArgs`` field names) of a capture engine;
    with ``handoff_dir`` the hook hands rows over through shared memory there;
    ``device`` other than ``auto`` is SGLang's ``device`` (``cpu``: its CPU engine);
    ``final_state`` is the final state the rows carry."""
    opts = {**DEFAULT_OPTIONS, **options}
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


def append_last_hidden_states_hook(config: Mapping[str, Any]) -> Callable[..., None]:
    """Forward-hook factory SGLang calls in each worker (``forward_hooks``).

    Under full capture with aux states, ``output.hidden_states`` holds the aux rows
    and ``output.last_hidden_states`` the post-norm rows of the same tokens; the
    hook puts both into the returned rows as ``[aux | last]`` (``last`` the pre-norm
    rows when ``config["final_state"]`` says so).
    """
    final_state = config["final_state"]  # engine_args always says (no default here)

    def hook(_module: Any, _inputs: Any, output: Any) -> None:
        parts = _captured_parts(output, final_state)
        if parts is not None:
            output.hidden_states = torch.cat(parts, dim=-1)
            output.last_hidden_states = None

    return hook


def shared_rows_hook(config: Mapping[str, Any]) -> Callable[..., None]:
    """Forward-hook factory of the shared-memory hand-off (:mod:`.handoff`): the joined
    ``[aux | last]`` rows go to a file in ``config["directory"]`` and SGLang returns
    their ``[T, 3]`` pointers instead."""
    writer = handoff.RowsWriter(config["directory"])
    final_state = config["final_state"]

    def hook(_module: Any, _inputs: Any, output: Any) -> None:
        parts = _captured_parts(output, final_state)
        if parts is not None:
            output.hidden_states = writer.put(parts)
            output.last_hidden_states = None

    return hook


# This worker's final-norm input of the forward running now (pre_norm_hook), taken by the
# logits processor's hook of the same forward.
_pre_norm_rows: list[torch.Tensor] = []


def pre_norm_hook(_config: Mapping[str, Any]) -> Callable[..., None]:
    """Forward-hook factory for the decoder's final norm: keeps its input, the pre-norm
    state. SGLang's norm takes ``(x, residual)`` and returns ``(normed, x + residual)``
    (its fused kernel may overwrite ``x`` in place): the updated residual is the input
    it normalized; without a residual the input is ``x``."""

    def hook(_module: Any, inputs: Any, output: Any) -> None:
        if isinstance(output, tuple) and len(output) == 2 and output[1] is not None:
            pre = output[1]
        else:
            pre = inputs[0]
        # A copy: the residual's storage is the layer stack's, reused by the next forward.
        _pre_norm_rows[:] = [pre.detach().clone()]

    return hook


def _captured_parts(output: Any, final_state: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(aux, last) of a full-capture forward, in the aux dtype; None for any other
    forward (decode, warm-up, a batch that asked for no states) or when a hook already ran."""
    aux = getattr(output, "hidden_states", None)
    last = getattr(output, "last_hidden_states", None)
    if aux is None or last is None or aux.shape[0] != last.shape[0]:
        return None
    if final_state == PRE_NORM and last.shape[0] == 0:
        # An idle forward (a data-parallel attention group with no request this step):
        # SGLang skips the final norm, and there is no row to replace.
        _pre_norm_rows.clear()
    elif final_state == PRE_NORM:
        pre = _pre_norm_rows.pop() if _pre_norm_rows else None
        if pre is None or pre.shape != last.shape:
            # Raised in the worker: the engine stops and the job names this rank.
            raise SGLangCaptureError(
                f"the final norm's input of this forward was "
                f"{'not seen' if pre is None else f'{list(pre.shape)}'} where the post-norm "
                f"state is {list(last.shape)}: the hook on {FINAL_NORM_MODULES} did not run "
                f"once per forward (hidden_states.final_state: post_norm captures without it)"
            )
        last = pre
    return aux, last.to(aux.dtype)


def split_states(
    output: Mapping[str, Any],
    length: int,
    hidden_size: int,
    dtype: torch.dtype,
    reader: handoff.RowsReader | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [T, 3H], last [T, H]) from one ``Engine.generate`` result, checked: the rows
    themselves (``lists``) or, with ``reader``, views of the rows they point at."""
    block = _prefill_block(output, length)
    if reader is not None:
        rows = reader.rows(block, length)
    else:
        rows = torch.tensor(block, dtype=torch.float32)
        width = rows.shape[1]
        if width != 4 * hidden_size:
            raise SGLangCaptureError(
                f"SGLang returned {width} values per token, expected 3 aux layers + the "
                f"final-norm state = {4 * hidden_size} (hidden_size {hidden_size}); is the "
                f"forward hook {HOOK_FACTORY} registered and does the model capture 3 "
                f"layers?"
            )
        # float32 -> model dtype is exact: the values were the model dtype's own.
        rows = rows.to(dtype)
    return rows[:, : 3 * hidden_size], rows[:, 3 * hidden_size :]


def _prefill_block(output: Mapping[str, Any], length: int) -> list[list[float]]:
    """The prompt's rows of one result, checked to be one per token."""
    meta = output.get("meta_info", {})
    blocks = meta.get("hidden_states")
    if not blocks:
        raise SGLangCaptureError(
            "SGLang returned no hidden states; the engine must run with "
            "enable_return_aux_hidden_states and the request with return_hidden_states"
        )
    prompt_tokens = meta.get("prompt_tokens", length)
    cached = meta.get("cached_tokens", 0) or 0
    block = blocks[0]
    square = bool(block) and all(isinstance(r, list) for r in block)
    if not square or len(block) != length or prompt_tokens != length or cached:
        raise SGLangCaptureError(
            f"SGLang returned {len(block) if square else 0} hidden-state rows for "
            f"a {length}-token sample (prompt_tokens={prompt_tokens}, cached_tokens="
            f"{cached}); expected one row per token. A radix-cache hit or chunked "
            f"prefill computes only part of the prompt: run with disable_radix_cache "
            f"and chunked_prefill_size=-1"
        )
    return block


def start_engine(kwargs: Mapping[str, Any]) -> Any:
    """A real ``sglang.Engine`` (needs the ``gpu`` extra, and CUDA GPUs unless ``device``
    is ``cpu``), its workers writing to this job's log (:func:`workers_write_to_job_log`)
    and a worker's failure raised here (:func:`worker_failed`)."""
    if kwargs.get("device") == "cpu":
        # SGLang chooses its CPU platform from this variable alone (is_cpu()), at import,
        # in this process and the workers it spawns; device="cpu" without it dies in the
        # unknown-device path (seen with sglang 0.5.23).
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    try:
        import sglang
    except ImportError as exc:
        raise SGLangCaptureError(
            "hidden_states.backend is sglang but sglang is not installed; "
            "install the gpu extra: pip install -e '.[gpu]' -c constraints/gpu.txt"
        ) from exc
    with workers_write_to_job_log():
        engine = sglang.Engine(**{"custom_sigquit_handler": worker_failed, **kwargs})
    keep_job_signal_handlers(engine)
    return engine


def keep_job_signal_handlers(engine: Any) -> None:
    """Give SIGTERM and SIGQUIT back to the job once the engine is up.

    SGLang's tokenizer manager moves both into its asyncio loop on the engine's first
    request (``loop.add_signal_handler``, sglang 0.5.23), with handlers made for a server:
    SIGTERM then waits for the requests in flight and SIGKILLs the whole process tree, and
    a worker's failure (SIGQUIT) SIGKILLs it at once, this job included: the job died with
    no line in its log, its hand-off and SGLang's shared memory left behind (seen on
    SGLang's CPU engine: a rank that failed in the middle of a shard). So the loop is
    created now, its two handlers are removed, and the job's own (:func:`worker_failed`,
    the job's stop on SIGTERM) return.
    """
    manager = getattr(engine, "tokenizer_manager", None)
    loop = getattr(engine, "loop", None)
    if not hasattr(manager, "auto_create_handle_loop") or loop is None:
        return
    own = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGQUIT)}

    async def create_in_the_engines_loop() -> None:
        # Both inside the running loop: outside, the manager would make a loop of its own
        # that the engine never runs (every request then waits forever), and uvloop (the
        # engine's loop) removes a signal handler only while it runs (seen).
        manager.auto_create_handle_loop()
        for sig in own:
            loop.remove_signal_handler(sig)

    loop.run_until_complete(create_in_the_engines_loop())
    for sig, handler in own.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


# The engine's processes once it started, for worker_failed: a job runs one engine.
_engine_watch: EngineWatch | None = None
# What worker_failed found, for a failure inside the engine's event loop (see there).
_worker_failure: str | None = None


def worker_failed(_signum: int, _frame: Any) -> None:
    """SIGQUIT handler of the engine's process (``custom_sigquit_handler``, and again
    once the engine runs: :func:`keep_job_signal_handlers`).

    SGLang's workers, and its watchdog of them, send SIGQUIT to the engine's process when
    a worker fails or dies, and SGLang's own handler then SIGKILLs the whole process tree,
    this job included: the job died with no line in its log (seen with sglang 0.5.23).
    This one names the worker that ended and how (:class:`EngineWatch`), stops the other
    workers the same way, and fails the job with that line. Later SIGQUITs of the same
    collapse (every rank notices) are ignored.

    Inside a request the engine's event loop (uvloop) runs Python's signal handlers and
    logs whatever they raise, but a KeyboardInterrupt, instead of raising it: there the
    handler stops the loop, ``Engine.generate`` raises, and :meth:`SGLangCapture.forward`
    raises the failure in its place."""
    from sglang.srt.utils import kill_process_tree

    global _worker_failure
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)
    watch = _engine_watch or EngineWatch(_before_engine)
    _worker_failure = (
        f"{watch.failure()}; the capture stopped, this shard's partial file is discarded, "
        f"and the same command redoes the shard"
    )
    kill_process_tree(os.getpid(), include_parent=False)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise SGLangCaptureError(_worker_failure) from None
    loop.stop()


@contextlib.contextmanager
def workers_write_to_job_log() -> Iterator[None]:
    """Keep this job's log through an engine start (sglang 0.5.23 facts):

    * stderr, which the engine's worker processes inherit when they start, points at the
      job's log file for the duration of the block (this process gets its own back): the
      scheduler and detokenizer log to stderr, which for a Snakemake job is the console of
      the whole run, and a worker's traceback was lost there;
    * the root logger's handlers and level are put back afterwards: the engine reconfigures
      logging (``basicConfig(force=True)``), which dropped the job's log file, so no later
      line of the job reached it."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    logs = [h for h in handlers if isinstance(h, logging.FileHandler)]
    saved = None
    try:
        if logs:
            sys.stderr.flush()
            saved = os.dup(2)
            with open(logs[0].baseFilename, "ab", buffering=0) as job_log:
                os.dup2(job_log.fileno(), 2)
        yield
    finally:
        if saved is not None:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        root.handlers[:] = handlers
        root.setLevel(level)


def drop_messaging_contexts() -> None:
    """Close every ZeroMQ context of this process without lingering.

    An ``sglang.Engine`` whose scheduler dies while it starts raises, but leaves its ZeroMQ
    contexts (``zmq.Context(2)`` in the engine and its tokenizer manager) holding messages for
    processes that never connected. Their sockets linger forever by default, so the
    interpreter's exit blocks in ``Context.term()`` and the job hangs instead of failing
    (seen with sglang 0.5.23: a scheduler that died at import kept the job alive until
    killed). SGLang keeps no handle to them, hence the search of the heap; only a failed
    start calls this, when nothing else in the job uses ZeroMQ.
    """
    zmq = sys.modules.get("zmq")
    if zmq is None:
        return
    for obj in gc.get_objects():
        if isinstance(obj, zmq.Context) and not obj.closed:
            obj.destroy(linger=0)


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
        opts = {**DEFAULT_OPTIONS, **(options or {})}
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
        global _before_engine, _engine_watch
        _before_engine = process_keys(descendants(os.getpid()))
        self._own_files = shm_files([os.getpid()])
        try:
            self.engine = engine_factory(self.engine_kwargs)
        except BaseException:
            self.close()
            drop_messaging_contexts()
            raise
        self._watch = _engine_watch = EngineWatch(_before_engine)
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
            if _worker_failure is not None:  # worker_failed stopped the engine's loop
                raise SGLangCaptureError(_worker_failure) from None
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
_before_engine: set[tuple[int, int]] = set()


def job_log_path() -> str | None:
    """The job's log file (run_step's file handler), where the reaper writes its line."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return handler.baseFilename
    return None
