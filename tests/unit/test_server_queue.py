"""The servers' queue gauges and which of our requests still wait in a server's queue."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3data.generation.engines.server_queue import (
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
"""


def test_vllm_gauges_are_summed_over_engines() -> None:
    assert VLLMMetrics().parse(VLLM_METRICS) == ServerQueue(running=7, waiting=5)
    # A server without the gauges (another version) reports nothing.
    assert VLLMMetrics().parse("# nothing\nvllm:other 1\n") is None


def test_sglang_loads_are_summed_over_ranks() -> None:
    body = {
        "loads": [
            {"dp_rank": 0, "num_running_reqs": 2, "num_waiting_reqs": 9},
            {"dp_rank": 1, "num_running_reqs": 3, "num_waiting_reqs": 1},
        ]
    }
    assert SGLangLoads().parse(json.dumps(body)) == ServerQueue(running=5, waiting=10)
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
    queues = {"a": ServerQueue(running=8, waiting=2), "b": ServerQueue(running=8, waiting=0)}
    assert queued_positions(sent, queues) == {1, 2, 5}
    # More waiting than ours (other clients'): all of ours on that server wait.
    assert queued_positions(sent, {"a": ServerQueue(1, 50)}) == {0, 1, 2, 5}
    # A server that reported nothing: its requests count as started.
    assert queued_positions(sent, {}) == {5}
