"""What real SGLang 0.5.23 does with a request that is aborted or whose client goes away,
and the gauges that show its queue: the facts the fake server
(``tests/support/fake_openai.py``: ``rid``, ``POST /abort_request``, ``disconnect_check_s``,
``/v1/loads``, ``/metrics``) and the driver's cancellation rely on.

One server (``--max-running-requests 1``: a second request waits in SGLang's queue, and
``SGLANG_REQUEST_STATE_WAIT_TIMEOUT`` = :data:`CHECK_S`). Seen on the 2-core machine, tiny
Qwen3 at ~135 tokens/s (the same with the default 4 s check, by a script):

* ``POST /abort_request {"rid"}`` answers 200 with an empty body, also for an unknown rid;
  the aborted request's own reply comes at once (~20 ms): 200, ``finish_reason:
  "abort"``, ``matched_stop: null``, ``id`` = the rid, the text and ids decoded so far,
  ``usage.completion_tokens`` = tokens decoded so far; a request aborted while still
  queued: ``content: ""``, ``response_token_ids: []``, and ``usage`` all 0, its
  ``prompt_tokens`` included (``prompt_token_ids`` still there).
* The request log gets ``Finish`` lines for both, ``finish_reason`` type ``abort``, with
  the tokens decoded (0 for the queued one); ``sglang:num_aborted_requests_total`` counts
  both, ``sglang:generation_tokens_total`` counts the running one's tokens.
* ``sglang:generation_tokens_total`` moves when a request leaves (finished or aborted),
  not while it decodes (unlike vLLM's, which counts every step).
* A client that closes the connection of a non-streaming request: SGLang notices it only
  at the request's next check (every ``SGLANG_REQUEST_STATE_WAIT_TIMEOUT`` seconds since
  it arrived) and decodes until then: closed at 1.0 s and at 2.5 s, the request stopped
  4.06 s and 4.15 s after it arrived with the default 4 s (~500 tokens each, counted in
  ``generation_tokens_total``, one more abort each in ``num_aborted_requests_total``).

A second server with a KV cache too small for what it admits (``--max-total-tokens 700``,
``--schedule-conservativeness 0.05``): when the cache is full SGLang retracts a decoding
request back to its queue ("KV cache pool is full. Retract requests." in its log), and
``/v1/loads?include=core,queues`` says ``queues.retracted`` (how many its last retraction
sent back) until its next decode-stats log: about 0.3 s here, the queue holding the
retracted request among the waiting; the request later finishes whole.

Re-record (``tests/data/sglang/queue/`` and ``tests/data/sglang/metrics.txt``):
``EAGLE3DATA_RECORD_SGLANG=tests/data/sglang .venv-sglang/bin/pytest tests/sglang/test_abort.py``.
The replies live in a subfolder because ``test_generate_server.py`` holds the top level of
``tests/data/sglang/`` to exactly the cases it records.
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
from support.sglang_server import RECORD_ENV, SGLangServer
from support.target_models import make_qwen3_dir

from eagle3data.servers.queue import SGLangLoads

pytestmark = pytest.mark.e2e

CHECK_S = 2  # SGLANG_REQUEST_STATE_WAIT_TIMEOUT of this module's server
RUNNING = "sglang:num_running_reqs"
QUEUED = "sglang:num_queue_reqs"
GENERATED = "sglang:generation_tokens_total"
ABORTED = "sglang:num_aborted_requests_total"
METRICS = (RUNNING, QUEUED, GENERATED, ABORTED)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServer]:
    base = tmp_path_factory.mktemp("sglang-abort")
    model = make_qwen3_dir(base / "tiny-qwen3")
    extra = ("--max-running-requests", "1")
    with SGLangServer(
        model, log_path=base / "server.log", extra_args=extra, request_state_wait_timeout_s=CHECK_S
    ) as running:
        yield running


def long_chat(rid: str | None = None, max_tokens: int = 900) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": SERVED_MODEL,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0.0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "chat_template_kwargs": {"enable_thinking": False},
        "return_token_ids": True,
    }
    if rid is not None:
        body["rid"] = rid
    return body


def post(server: SGLangServer, path: str, body: Any) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port or 0, timeout=300)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


class Request(threading.Thread):
    """A chat request in the background; ``status``, ``reply`` once joined."""

    def __init__(self, server: SGLangServer, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.server, self.body = server, body
        self.status: int | None = None
        self.reply: Any = None
        self.start()

    def run(self) -> None:
        self.status, raw = post(self.server, "/v1/chat/completions", self.body)
        self.reply = json.loads(raw)


def loads(server: SGLangServer, route: str = "/v1/loads?include=core") -> dict[str, Any]:
    status, body = server.get(route)
    assert status == 200, body
    return dict(body)


def record(name: str, data: Any) -> None:
    out = os.environ.get(RECORD_ENV)
    if not out:
        return
    path = Path(out) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    text = data if isinstance(data, str) else json.dumps(data, indent=1, ensure_ascii=False) + "\n"
    path.write_text(text, encoding="utf-8")


def test_a_retraction_shows_in_the_queue_gauge(tmp_path: Path) -> None:
    """Requests SGLang sends back to its queue after decoding them (a full KV cache) wait
    there with what they decoded: the gauge the driver reads says so
    (``servers.queue.SGLangLoads``: ``retracted``), so it is not read as this job's newest
    requests waiting (``servers.queue.SentBack``)."""
    model = make_qwen3_dir(tmp_path / "tiny-qwen3", context=4096)
    extra = ("--max-total-tokens", "700", "--max-running-requests", "8")
    extra += ("--schedule-conservativeness", "0.05")
    route = SGLangLoads.route
    with SGLangServer(model, log_path=tmp_path / "server.log", extra_args=extra) as server:
        # Not ignore_eos: SGLang reserves all of max_tokens for those and admits one.
        bodies = [{**long_chat(max_tokens=400), "ignore_eos": False} for _ in range(8)]
        for i, body in enumerate(bodies):
            body["messages"] = [{"role": "user", "content": f"Tell me a long story, number {i}"}]
        requests = [Request(server, body) for body in bodies]
        retracted = []
        while any(r.is_alive() for r in requests):
            body = loads(server, route)
            if any((load.get("queues") or {}).get("retracted") for load in body["loads"]):
                retracted.append(body)
            time.sleep(0.02)
        log = (tmp_path / "server.log").read_text()
    assert "KV cache pool is full. Retract requests." in log
    assert retracted, "no reading showed the retraction"
    queue = SGLangLoads().parse(json.dumps(retracted[0]))
    assert queue is not None and queue.retracted and queue.waiting > 0
    assert all(r.status == 200 for r in requests)
    record(
        "queue/loads_retracted.json",
        {"request": {"get": route}, "status": 200, "response": retracted[0]},
    )


def test_abort_by_rid_answers_the_request_with_what_it_decoded(server: SGLangServer) -> None:
    before = parse_metrics(server.metrics_text())
    offset = server.log_offset()
    running = Request(server, long_chat("abort-running"))
    wait_for(lambda: loads(server)["loads"][0]["num_running_reqs"] == 1)
    queued = Request(server, long_chat("abort-queued"))
    wait_for(lambda: loads(server)["loads"][0]["num_waiting_reqs"] == 1)
    busy = loads(server)
    # /metrics' gauges follow when the scheduler logs its decode stats (every 40 steps),
    # /v1/loads' at once.
    wait_for(lambda: parse_metrics(server.metrics_text())[QUEUED] == 1.0, timeout=20)
    metrics_text = server.metrics_text()
    busy_metrics = parse_metrics(metrics_text)
    assert (busy_metrics[RUNNING], busy_metrics[QUEUED]) == (1.0, 1.0)
    # Counted when a request leaves, not while it decodes.
    assert busy_metrics[GENERATED] == before.get(GENERATED, 0.0)

    assert post(server, "/abort_request", {"rid": "abort-queued"}) == (200, b"")
    queued.join(30)
    time.sleep(0.3)
    started = time.monotonic()
    assert post(server, "/abort_request", {"rid": "abort-running"}) == (200, b"")
    running.join(30)
    assert not running.is_alive() and time.monotonic() - started < 2.0
    assert post(server, "/abort_request", {"rid": "no-such-request"}) == (200, b"")

    q, r = queued.reply, running.reply
    assert queued.status == running.status == 200
    for reply, rid in ((q, "abort-queued"), (r, "abort-running")):
        choice = reply["choices"][0]
        assert (reply["id"], choice["finish_reason"], choice["matched_stop"]) == (
            rid,
            "abort",
            None,
        )
        usage = reply["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert q["usage"]["prompt_tokens"] == q["usage"]["completion_tokens"] == 0
    assert q["choices"][0]["message"]["content"] == ""
    assert q["choices"][0]["response_token_ids"] == [] and q["choices"][0]["prompt_token_ids"]
    decoded = r["usage"]["completion_tokens"]
    assert 0 < decoded < 900 and r["usage"]["prompt_tokens"] > 0
    assert len(r["choices"][0]["response_token_ids"]) == decoded

    log = server.requests_since(offset)
    assert log.finished["abort-queued"] == ("abort", 0)
    assert log.finished["abort-running"] == ("abort", decoded)
    wait_for(lambda: parse_metrics(server.metrics_text()).get(ABORTED, 0.0) >= 2)
    after = parse_metrics(server.metrics_text())
    assert after[ABORTED] - before.get(ABORTED, 0.0) == 2
    assert after[GENERATED] - before.get(GENERATED, 0.0) == decoded

    record("queue/chat_aborted_queued.json", {"request": queued.body, "status": 200, "response": q})
    record(
        "queue/chat_aborted_running.json", {"request": running.body, "status": 200, "response": r}
    )
    record(
        "queue/loads.json",
        {"request": {"get": "/v1/loads?include=core"}, "status": 200, "response": busy},
    )
    record("metrics.txt", trimmed_metrics(metrics_text, METRICS))


def close_after(server: SGLangServer, body: dict[str, Any], seconds: float) -> float:
    """Send ``body`` on a raw connection and close it after ``seconds``; returns when the
    request was sent (monotonic)."""
    data = json.dumps(body).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port or 0)) as sock:
        sock.sendall(head.encode() + data)
        sent = time.monotonic()
        time.sleep(seconds)
    return sent


@pytest.mark.parametrize("closed_at", [0.5, CHECK_S + 0.5])
def test_a_closed_connection_is_noticed_at_the_next_check(
    server: SGLangServer, closed_at: float
) -> None:
    """The request decodes on until the next multiple of the check interval since it
    arrived, then stops; its tokens are counted."""
    before = parse_metrics(server.metrics_text())
    sent = close_after(server, long_chat(), closed_at)
    wait_for(lambda: loads(server)["loads"][0]["num_running_reqs"] == 0, timeout=30)
    stopped = time.monotonic() - sent
    next_check = CHECK_S * (int(closed_at // CHECK_S) + 1)
    assert next_check - 0.2 <= stopped <= next_check + 1.0, (closed_at, stopped)
    wait_for(
        lambda: parse_metrics(server.metrics_text()).get(ABORTED, 0.0) > before.get(ABORTED, 0.0)
    )
    after = parse_metrics(server.metrics_text())
    assert after[GENERATED] > before.get(GENERATED, 0.0)  # what it decoded until the check
