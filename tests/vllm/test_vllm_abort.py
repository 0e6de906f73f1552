"""What real vLLM 0.32 does with a request whose client goes away, and the gauges that show
its queue: the facts the fake server's ``dialect="vllm"`` (``/metrics``,
``disconnect_check_s=0``) and the driver's cancellation rely on.

One server (``--max-num-seqs 1``: a second request waits). Seen on the 2-core machine, a
24-layer tiny Qwen3 at ~105 tokens/s:

* ``/metrics`` (on without a flag): ``vllm:num_requests_running`` and
  ``vllm:num_requests_waiting`` (gauges), ``vllm:generation_tokens_total`` (a counter
  that moves with every decode step: 173 tokens 1.5 s into a request), each labelled
  ``{engine="0",model_name=...}``; a request whose client hung up is in none of
  ``vllm:request_success_total``'s ``finished_reason`` series (``abort`` stays 0).
* A client that closes the connection of a running non-streaming request: the request
  leaves the batch at once (``num_requests_running`` 0 at the first look, 10 ms after the
  close) and ``generation_tokens_total`` stops there (closed at 1 s: 120 tokens, at 2 s:
  233, unchanged for the next 4 s): what it decoded is counted, nothing more is decoded.
  A waiting request whose client closes leaves the queue at once and decodes nothing.
  vLLM has no abort-by-id endpoint; closing the connection is its abort.

Re-record ``tests/data/vllm/metrics.txt``:
``EAGLE3DATA_RECORD_VLLM=tests/data/vllm .venv/bin/pytest tests/vllm/test_vllm_abort.py``.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.local_server import parse_metrics
from support.real_servers import SERVED_MODEL, trimmed_metrics, wait_for
from support.target_models import make_qwen3_dir
from support.vllm_server import HEAD_DIM, RECORD_ENV, VLLMServer

pytestmark = pytest.mark.e2e

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
GENERATED = "vllm:generation_tokens_total"
FINISHED = "vllm:request_success_total"
METRICS = (RUNNING, WAITING, GENERATED, FINISHED)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    base = tmp_path_factory.mktemp("vllm-abort")
    # 24 layers: a 900-token answer takes seconds, not a fraction of one, here. A 4096-token
    # context, for an answer that a faster CPU cannot finish before the test closes it (CI's
    # machine once decoded all 900 tokens before the close at 1 s).
    model = make_qwen3_dir(base / "tiny-qwen3", head_dim=HEAD_DIM, layers=24, context=4096)
    with VLLMServer(model, log_path=base / "server.log", max_num_seqs=1) as running:
        yield running


def long_chat(max_tokens: int = 900) -> dict[str, Any]:
    return {
        "model": SERVED_MODEL,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0.0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "chat_template_kwargs": {"enable_thinking": False},
    }


class Request(threading.Thread):
    """A chat request in the background; ``status`` once joined."""

    def __init__(self, server: VLLMServer, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.server, self.body = server, body
        self.status: int | None = None
        self.start()

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.server.port or 0, timeout=300)
        try:
            conn.request(
                "POST", "/v1/chat/completions", json.dumps(self.body),
                {"Content-Type": "application/json"},
            )  # fmt: skip
            response = conn.getresponse()
            response.read()
            self.status = response.status
        finally:
            conn.close()


class Closing:
    """A chat request on a raw connection, closed by :meth:`close`."""

    def __init__(self, server: VLLMServer, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        )
        self.sock = socket.create_connection(("127.0.0.1", server.port or 0))
        self.sock.sendall(head.encode() + data)

    def close(self) -> None:
        self.sock.close()


def abort_series(text: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(FINISHED + "{") and 'finished_reason="abort"' in line
    )


def test_queue_gauges_and_a_token_counter_that_moves_while_decoding(server: VLLMServer) -> None:
    before = server.metrics()
    running = Request(server, long_chat())
    wait_for(lambda: server.metrics()[RUNNING] == 1)
    waiting = Request(server, long_chat(50))
    wait_for(lambda: server.metrics()[WAITING] == 1)
    time.sleep(0.5)
    text = server.metrics_text()
    busy = parse_metrics(text)
    assert (busy[RUNNING], busy[WAITING]) == (1.0, 1.0)
    assert busy[GENERATED] > before[GENERATED]  # counted step by step
    running.join(120)
    waiting.join(120)
    assert running.status == waiting.status == 200
    assert server.metrics()[GENERATED] - before[GENERATED] == 950
    out = os.environ.get(RECORD_ENV)
    if out:
        Path(out, "metrics.txt").write_text(trimmed_metrics(text, METRICS), encoding="utf-8")


LONGEST = 4000  # tokens: the model's context less the prompt


def test_a_closed_connection_stops_the_decode_at_once(server: VLLMServer) -> None:
    before_text = server.metrics_text()
    before = parse_metrics(before_text)
    closing = Closing(server, long_chat(LONGEST))
    wait_for(lambda: server.metrics()[GENERATED] > before[GENERATED])
    time.sleep(0.5)
    closing.close()
    closed = time.monotonic()
    wait_for(lambda: server.metrics()[RUNNING] == 0, timeout=5)
    assert time.monotonic() - closed < 1.0
    time.sleep(0.3)
    spent = server.metrics()[GENERATED] - before[GENERATED]
    time.sleep(2.0)
    after_text = server.metrics_text()
    assert parse_metrics(after_text)[GENERATED] - before[GENERATED] == spent  # nothing more
    assert 0 < spent < LONGEST
    assert abort_series(after_text) == abort_series(before_text)  # not counted as finished

    # A waiting request whose client leaves decodes nothing.
    before = server.metrics()
    running = Request(server, long_chat(1000))
    wait_for(lambda: server.metrics()[RUNNING] == 1)
    closing = Closing(server, long_chat())
    wait_for(lambda: server.metrics()[WAITING] == 1)
    closing.close()
    wait_for(lambda: server.metrics()[WAITING] == 0, timeout=5)
    running.join(120)
    time.sleep(0.5)
    assert running.status == 200
    assert server.metrics()[GENERATED] - before[GENERATED] == 1000
