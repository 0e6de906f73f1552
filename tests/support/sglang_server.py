"""Real SGLang's OpenAI-compatible HTTP server on CPU for ``tests/sglang/``: start and stop
it, read its request log and ``/metrics``, and record what it sends (``tests/data/sglang/``;
what it shares with vLLM's is in ``support.local_server.WorkerServer`` and
``support.real_servers``).

Checked facts (sglang 0.5.23 in the environment ``tests/sglang/setup.sh`` builds, run as
:func:`support.sglang_cpu.sglang_env` sets it up; the tiny random Qwen3 of
``target_models.make_qwen3_dir``: Qwen3's real template, a 402-token byte-level vocabulary,
8 layers of width 64; flags as in :meth:`SGLangServer.command`; a 2-core AMD EPYC without
AMX, shared with other work. ``tests/sglang/test_generate_server.py`` asserts the ones marked
[T]; "(code)" marks what was read in SGLang's source, not seen; the bodies themselves are
in ``tests/data/sglang/``, recorded by :func:`record_bodies`):

Start-up and stop
* ``--mem-fraction-static`` must be given (left automatic it comes out negative on CPU and
  the KV pool cannot be sized); with ``--max-total-tokens 8192`` the pool is 8192 tokens
  whatever the fraction. Cuda graphs are off by themselves with ``torch_native`` attention.
* Three processes in the launcher's process group (launcher, ``sglang::scheduler``,
  ``sglang::detokenizer``) plus multiprocessing's resource tracker, ~1 GB RSS each for this
  model. Ready (``GET /health`` 200) 32-38 s after the launch here (the earlier session's
  135M model under heavy load: ~150 s). ``/health`` answers 503 while the server warms up
  (it sends itself one ``/generate``), then 200 without generating (code). SIGTERM to the group:
  every process gone in a few seconds (:attr:`SGLangServer.stop_s`); a dead launcher's
  children can linger as zombies (PID 1 here reaps late), which :func:`group_processes`
  does not count.
* ``--enable-metrics`` needs ``prometheus_client`` (not among sglang's CPU-path imports
  otherwise); then ``/metrics`` has ``sglang:num_requests_total`` (every request, aborted
  ones included), ``sglang:num_aborted_requests_total`` (counted when the tokenizer
  manager sends the abort, only for a request it still holds, i.e. not finished: code) and
  ``sglang:generation_tokens_total`` (counted when a request leaves, finished or aborted,
  its decoded tokens included: ``tests/sglang/test_abort.py``; it does not move while a
  request decodes). The running/waiting gauges of ``/metrics`` lag by seconds (they follow
  the scheduler's stats log); ``/v1/loads?include=core`` is current.
* ``--log-requests --log-requests-level 0`` logs one ``Receive: obj=GenerateReqInput(rid=...``
  line per request and one ``Finish: ... out={'meta_info': {... 'finish_reason': {'type':
  ...}, ... 'completion_tokens': N ...`` line per request that finished, and per request
  aborted by its rid (``POST /abort_request``: type ``abort``, the tokens it had decoded, 0
  for one still queued); a request dropped because its client hung up gets no ``Finish``
  line and no other line at that level (:meth:`SGLangServer.requests_since`), nor does one
  refused after it arrived (the context-length 400s). The 400s for a malformed
  body come before, with no ``Receive`` line either.
* ``--tool-call-parser qwen25`` is deprecated for ``qwen`` (same parser).

Requests (``POST /v1/chat/completions``, non-streaming; shapes in ``tests/data/sglang/``)
* ``/v1/models``: one model, ``id`` = ``--served-model-name``, with ``owned_by: "sglang"``,
  ``root``, ``parent`` and ``max_model_len`` (the model's context, 1024 here). [T] The request's
  ``model`` is not checked (any name is answered and echoed), unknown fields are ignored.
* ``--reasoning-parser qwen3``: with thinking on (Qwen3's default) everything before
  ``</think>`` is ``message.reasoning_content``, also when the model never writes
  ``<think>``: a random model that never closes its thinking gets ``content: ""`` (an empty
  string, never null) and all its tokens as reasoning. [T] With ``chat_template_kwargs:
  {enable_thinking: false}`` the template closes the think block and the output is
  ``content`` with ``reasoning_content: null``. [T]
* ``usage``: ``prompt_tokens``, ``completion_tokens`` (reasoning included), ``total_tokens``,
  ``prompt_tokens_details`` (null), ``reasoning_tokens`` and ``completion_tokens_details``
  (``{"reasoning_tokens": n}``, null when n is 0). [T] ``completion_tokens`` counts the end
  token (an answer that is only ``<|im_end|>`` has 1) and a matched stop string's tokens,
  whose text is cut from the output.
* ``finish_reason``: ``"length"`` (exactly ``max_tokens`` completion tokens [T]), ``"stop"``
  (end token: ``matched_stop`` is its id, an int; a stop string: ``matched_stop`` is the
  string) [T], ``"tool_calls"`` (a parsed call and the model stopped) [T], ``"abort"`` (the
  scheduler dropped the request without a status, in a 200 body; with one it is an HTTP
  error: 400 for its 400s, else the status, e.g. 503 for a decode-memory retraction) (code).
  Every choice has ``matched_stop`` and ``logprobs`` keys; the body a top-level ``metadata``
  (``weight_version``, ``weight_versions``). [T]
* Tool calls (``--tool-call-parser qwen``): ``message.tool_calls`` = ``[{"id": "call_<hex>",
  "index": 0, "type": "function", "function": {"name", "arguments": "<JSON string>"}}]``,
  ``content: ""``. [T] ``tool_choice: "required"`` (or a named function) constrains the
  output to ``<tool_call>\\n{"name":..., "arguments":...}`` with xgrammar, the arguments to
  the tool's schema only with ``function.strict: true``; whitespace inside the arguments
  stays free (``--constrained-json-disable-any-whitespace`` applies to JSON-schema
  constraints, not to this structural tag: seen), so a random model writes blanks forever
  unless ``logit_bias`` forbids them (:func:`forced_tool_call_body`). With
  thinking on the grammar starts after ``</think>``. A call cut by ``max_tokens`` is
  dropped (content ``""``, no ``tool_calls``, a warning in the log).
* History: assistant ``reasoning_content`` and ``tool_calls`` (``arguments`` as a JSON
  string, decoded to an object for the template) and tool turns' ``tool_call_id``/``name``
  are accepted and rendered. [T] The prompt SGLang renders equals eagle3data's
  ``chat.render`` for plain conversations [T], but NOT with tools: every tool reaches the
  template with an added ``"defer_loading": null`` (the ``Tool`` model of
  ``entrypoints/openai/protocol.py`` dumps its unset field; ``Function`` drops its own), so
  Qwen3's ``tool | tojson`` renders a key the client never sent. [T]
* Tool-call ids are random (``call_`` + 24 hex digits of a uuid4) for every parser but
  Kimi's (``functions.<name>:<n>``) (code), so two requests never get the same id. [T]
  Whether tool results pair with the calls before them (each call answered once, by id)
  is checked only for MiniMax-M3 (``_validate_minimax_m3_request``; code): with Qwen3 a
  history whose results answer no call of the turn before is accepted. [T]
* ``return_token_ids: true`` adds ``prompt_token_ids`` and ``response_token_ids`` to the
  choice [T] (``return_prompt_token_ids`` the first only; code).
* Errors have SGLang's flat body ``{"object": "error", "message", "type", "param", "code"}``,
  not OpenAI's ``{"error": {...}}``. A prompt longer than the context: 400 ``type
  "BadRequestError"``, "The input (N tokens) is longer than the model's context length (C
  tokens)."; a prompt that fits but not with ``max_tokens``: 400, "Requested token count
  exceeds the model's maximum context length of C tokens. ..." (no clamping). [T] A malformed
  body (``messages`` not a list): 400 ``type "Bad Request"`` with pydantic's error. [T]
  ``max_tokens: 0``: 200 with 0 completion tokens (and, oddly, ``reasoning_tokens: 1``).
  Errors from SGLang's HTTPException handler (5xx): the same flat body, ``type`` the status
  as a string (code). A failed API key: 401 ``{"error": "Unauthorized"}`` (code).

Cancellation
* A non-streaming request whose client hung up is aborted when SGLang next looks:
  ``tokenizer_manager`` wakes every ``SGLANG_REQUEST_STATE_WAIT_TIMEOUT`` seconds (default 4)
  while the request waits or runs, sees the closed connection and sends the scheduler an
  abort (running, or still queued) (code): up to that long of decoding is wasted per
  request (seen once with the default, by /metrics: 3 requests dropped 6 s into
  300-token answers had decoded ~286 tokens each when aborted). The tests set 1 s.
  Our engine aborts what it cancels by rid instead (``POST /abort_request``), at once:
  [T: every request our client dropped at a reached budget is aborted, running or waiting,
  and the tokens its Finish lines give are what the stats count as generated; at a SIGKILL
  of the job the requests are counted in ``num_aborted_requests_total`` and never finish]
* Greedy output did not depend on the batch: 8 prompts alone, 8 at once and 8 at once in
  the reverse order gave the same tokens (64 each). [T: an interrupted run resumed equals an
  uninterrupted one]
* Speed here: a decode step costs about the same for 1 or 8 requests (its overhead
  dominates): 5-13 tokens/s for one request while other work ran, 50-90 for a batch; the
  whole test module takes ~3 min with the server's start-up.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Unpack

from support.local_server import LocalServerError, ServerOptions, WorkerServer, server_flags
from support.real_servers import SERVED_MODEL, record_bodies, recording_cases, rerecord
from support.sglang_cpu import CPU_ENGINE_ARGS, sglang_env

RECORDED_DIR = Path(__file__).resolve().parents[1] / "data" / "sglang"
# Set to a folder to have tests/sglang/test_generate_server.py record the bodies there
# (RECORDED_DIR to re-record the committed ones).
RECORD_ENV = "EAGLE3DATA_RECORD_SGLANG"


class SGLangServerError(LocalServerError):
    """The server died or did not come up in time; the message ends with its log tail."""


@dataclass
class RequestLog:
    """What the server's request log says about the requests of a stretch of time."""

    received: list[str] = field(default_factory=list)  # rids, in arrival order
    finished: dict[str, tuple[str, int]] = field(default_factory=dict)  # rid -> (type, tokens)

    @property
    def unfinished(self) -> list[str]:
        """Requests that arrived and never finished: aborted, still running, or refused
        after they arrived (a context-length 400)."""
        return [rid for rid in self.received if rid not in self.finished]


_RECEIVE = re.compile(r"\] Receive: obj=GenerateReqInput\(rid='([^']+)'")
_FINISH = re.compile(r"\] Finish: obj=GenerateReqInput\(rid='([^']+)'")
_FINISH_TYPE = re.compile(r"'finish_reason': \{'type': '([a-z_]+)'")
_COMPLETION_TOKENS = re.compile(r"'completion_tokens': (\d+)")


def parse_request_log(text: str) -> RequestLog:
    log = RequestLog()
    for line in text.splitlines():
        if m := _RECEIVE.search(line):
            log.received.append(m.group(1))
        elif m := _FINISH.search(line):
            out = line[line.find("out={") :]
            kind = _FINISH_TYPE.search(out)
            tokens = _COMPLETION_TOKENS.search(out)
            log.finished[m.group(1)] = (
                kind.group(1) if kind else "?",
                int(tokens.group(1)) if tokens else -1,
            )
    return log


class SGLangServer(WorkerServer):
    """``python -m sglang.launch_server`` on 127.0.0.1, CPU, as a context manager.

    >>> with SGLangServer(make_qwen3_dir(tmp / "qwen3")) as server:
    ...     server.url         # "http://127.0.0.1:PORT/v1"
    ...     server.model_name  # "tiny-qwen3"

    The server runs in its own process group (session) with :func:`sglang_env`; leaving
    the block (or the interpreter) sends SIGTERM to the whole group, SIGKILL after
    ``stop_timeout`` seconds, and waits until no process of the group is left. Its output
    goes to ``log_path`` (a temp file unless given); :meth:`log_tail` for failure messages.
    ``base_url`` (no ``/v1``) is for ``/health`` and ``/metrics``.
    """

    error = SGLangServerError
    log_prefix = "sglang-server-"
    log_tail_chars = 6000
    default_startup_timeout = 900.0
    exited_message = "sglang.launch_server exited with code {code} before GET /health answered 200"
    not_ready_message = (
        "sglang.launch_server did not answer GET /health within {timeout:g} s (last: {last})"
    )

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        served_model_name: str = SERVED_MODEL,
        reasoning_parser: str | None = "qwen3",
        tool_call_parser: str | None = "qwen",
        mem_fraction_static: float = 0.05,
        request_state_wait_timeout_s: int | None = 1,
        **options: Unpack[ServerOptions],
    ) -> None:
        # startup_s: launch to the first /health 200; stop_s: SIGTERM to the last process
        # of the group gone.
        super().__init__(model, **options)
        self.served_model_name = served_model_name
        self.reasoning_parser = reasoning_parser
        self.tool_call_parser = tool_call_parser
        self.mem_fraction_static = mem_fraction_static
        self.request_state_wait_timeout_s = request_state_wait_timeout_s

    def command(self) -> list[str]:
        args: dict[str, Any] = {
            "model_path": self.model,
            "served_model_name": self.served_model_name,
            "host": "127.0.0.1",
            "port": self._chosen_port(),
            **CPU_ENGINE_ARGS,
            "mem_fraction_static": self.mem_fraction_static,
            "reasoning_parser": self.reasoning_parser,
            "tool_call_parser": self.tool_call_parser,
            "enable_metrics": True,
            "log_requests": True,
            "log_requests_level": 0,
        }
        return [self.python, "-m", "sglang.launch_server", *server_flags(args), *self.extra_args]

    def env(self) -> dict[str, str]:
        # No inherited SGLANG_* setting may change the server under test.
        base = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
        env = sglang_env(base)
        env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        if self.request_state_wait_timeout_s is not None:
            env["SGLANG_REQUEST_STATE_WAIT_TIMEOUT"] = str(self.request_state_wait_timeout_s)
        return env

    # -- what the server says ----------------------------------------------------------

    def requests_since(self, offset: int) -> RequestLog:
        return parse_request_log(self.log_text(offset))


def main(argv: Sequence[str] | None = None) -> int:
    """Re-record ``tests/data/sglang/``: start a server on a fresh tiny Qwen3 and record."""
    from transformers import AutoTokenizer

    from support.target_models import make_qwen3_dir

    def record(out: Path, tmp: Path) -> None:
        model = make_qwen3_dir(tmp / "qwen3")
        with SGLangServer(model, log_path=tmp / "server.log") as server:
            print(f"ready in {server.startup_s:.0f} s", flush=True)
            tokenizer = AutoTokenizer.from_pretrained(model)
            record_bodies(server, tokenizer, recording_cases(tokenizer), out)

    return rerecord(str(main.__doc__), RECORDED_DIR, record, argv)


if __name__ == "__main__":  # PYTHONPATH=tests .venv-sglang/bin/python -m support.sglang_server
    sys.exit(main())
