"""The servers' queue gauges and which of our requests still wait in a server's queue."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3data.servers.queue import (
    SentBack,
    SentRequest,
    ServerQueue,
    SGLangLoads,
    VLLMMetrics,
    gauge_for,
    queued_positions,
)

DATA = Path(__file__).resolve().parent.parent / "data"

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 5.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 5.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="tiny"} 2.0
vllm:num_preemptions_total{engine="1",model_name="tiny"} 1.0
"""


def test_vllm_gauges_are_summed_over_engines() -> None:
    assert VLLMMetrics().parse(VLLM_METRICS) == ServerQueue(
        running=7, waiting=5, queues_waiting=1, preemptions=3
    )
    # A server without the gauges (another version) reports nothing.
    assert VLLMMetrics().parse("# nothing\nvllm:other 1\n") is None


def test_sglang_loads_are_summed_over_ranks() -> None:
    body = {
        "loads": [
            {"dp_rank": 0, "num_running_reqs": 2, "num_waiting_reqs": 9},
            {"dp_rank": 1, "num_running_reqs": 3, "num_waiting_reqs": 1},
        ]
    }
    assert SGLangLoads().parse(json.dumps(body)) == ServerQueue(
        running=5, waiting=10, queues_waiting=2
    )
    assert SGLangLoads().parse('{"detail": "Not Found"}') is None
    assert SGLangLoads().parse("not json") is None


def test_the_gauge_follows_the_server_that_owns_the_model() -> None:
    assert isinstance(gauge_for("sglang"), SGLangLoads)
    assert isinstance(gauge_for("vllm"), VLLMMetrics)
    assert gauge_for("llamacpp") is None and gauge_for(None) is None


def test_the_newest_requests_on_a_server_are_the_ones_waiting() -> None:
    sent = [
        SentRequest(pos=0, endpoint="a", sent_at=1.0),
        SentRequest(pos=1, endpoint="a", sent_at=3.0),
        SentRequest(pos=2, endpoint="a", sent_at=2.0),
        SentRequest(pos=3, endpoint="b", sent_at=1.5),
        SentRequest(pos=4, endpoint="b", sent_at=2.5),
        SentRequest(pos=5, endpoint=None, sent_at=None),  # not sent: waits on our side
    ]
    queues = {"a": ServerQueue(running=1, waiting=2), "b": ServerQueue(running=2, waiting=0)}
    assert queued_positions(sent, queues) == {1, 2, 5}
    # A server that reported nothing: its requests count as started.
    assert queued_positions(sent, {}) == {5}


SENT = [SentRequest(pos=p, endpoint="a", sent_at=float(p)) for p in range(4)]


def test_a_queue_with_another_clients_requests_is_not_read_as_ours() -> None:
    """Our 4 requests and another client's 6 on one server (the other datasets' jobs, a
    capture job, someone else): which 3 wait cannot be told, so none of ours is read as
    waiting (a decoding one would be cancelled as costing nothing)."""
    assert queued_positions(SENT, {"a": ServerQueue(running=4, waiting=0)}) == set()
    assert queued_positions(SENT, {"a": ServerQueue(running=2, waiting=2)}) == {2, 3}
    assert queued_positions(SENT, {"a": ServerQueue(running=7, waiting=3)}) == set()
    assert queued_positions(SENT, {"a": ServerQueue(running=1, waiting=50)}) == set()


def test_several_data_parallel_queues_are_not_read_as_one() -> None:
    """Two ranks, one request waiting on each: the newest two of ours need not be those."""
    queue = ServerQueue(running=2, waiting=2, queues_waiting=2)
    assert queued_positions(SENT, {"a": queue}) == set()


def _read(sent_back: SentBack, queue: ServerQueue) -> set[int]:
    """One reading of server "a" as the driver makes it."""
    sent_back.update({"a": queue})
    return queued_positions(SENT, {"a": queue}, sent_back.endpoints)


def test_a_queue_vllm_has_preempted_into_is_not_read_as_free_until_it_empties() -> None:
    """vLLM puts preempted requests back among the waiting, with what they decoded: from
    the reading whose counter moved until one shows the queue empty."""
    sent_back = SentBack()
    assert _read(sent_back, ServerQueue(3, 1, 1, preemptions=5)) == {3}
    assert _read(sent_back, ServerQueue(3, 1, 1, preemptions=6)) == set()
    assert _read(sent_back, ServerQueue(3, 1, 1, preemptions=6)) == set()
    assert _read(sent_back, ServerQueue(4, 0, 0, preemptions=6)) == set()  # none waits
    assert _read(sent_back, ServerQueue(3, 1, 1, preemptions=6)) == {3}
    # A server whose counter is not seen at first is not taken for preempting later.
    assert _read(SentBack(), ServerQueue(3, 1, 1)) == {3}


def test_sglangs_retractions_are_read_from_its_loads() -> None:
    """Real SGLang 0.5.23 with its KV cache full (tests/sglang/test_abort.py): a decoding
    request retracted to the queue shows as ``queues.retracted`` for a while; until a
    reading shows the queue empty, the waiting are not read as our newest."""
    recorded = json.loads((DATA / "sglang" / "queue" / "loads_retracted.json").read_text())
    assert recorded["request"]["get"] == SGLangLoads.route
    queue = SGLangLoads().parse(json.dumps(recorded["response"]))
    assert queue == ServerQueue(running=1, waiting=7, queues_waiting=1, retracted=True)
    # The load of a request before (``include=core`` only): nothing said, nothing retracted.
    before = json.loads((DATA / "sglang" / "queue" / "loads.json").read_text())["response"]
    assert SGLangLoads().parse(json.dumps(before)) == ServerQueue(1, 1, 1)
    sent_back = SentBack()
    assert _read(sent_back, ServerQueue(1, 3, 1)) == {1, 2, 3}
    assert _read(sent_back, ServerQueue(1, 3, 1, retracted=True)) == set()
    assert _read(sent_back, ServerQueue(1, 3, 1)) == set()  # the flag gone, the request not
    assert _read(sent_back, ServerQueue(4, 0, 0)) == set()
    assert _read(sent_back, ServerQueue(1, 3, 1)) == {1, 2, 3}
