"""Generation, then capture: which endpoints the capture must not run beside, the refusal
while one answers, and the dry run's word on the next phase."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from eagle3data.hidden_states.phases import (
    PhaseError,
    capture_waits_for_all,
    check_generation_stopped,
    local_generation_endpoints,
    next_phase_line,
)


def box(**hidden: Any) -> dict[str, Any]:
    """Kimi-K2.5's box: an SGLang server on this machine, an 8-GPU SGLang capture."""
    return {
        "gpus": {"count": 8},
        "generation": {
            "backend": "openai",
            "endpoints": ["http://127.0.0.1:30000/v1", "http://gpu-node-7.example:30000/v1"],
        },
        "hidden_states": {"backend": "sglang", "sglang": {"tp_size": 8}, **hidden},
        "datasets": {"A1": {}, "B1": {}},
    }


def test_a_gpu_capture_waits_for_the_servers_on_this_machine_only() -> None:
    assert capture_waits_for_all(box())
    assert local_generation_endpoints(box()) == ["http://127.0.0.1:30000/v1"]


def test_capture_with_gpus_of_its_own_or_none_waits_for_nothing() -> None:
    assert not capture_waits_for_all(box(share_gpus_with_generation=False))
    assert local_generation_endpoints(box(share_gpus_with_generation=False)) == []
    on_cpu = box(device="cpu")  # SGLang's CPU engine takes no GPU
    assert not capture_waits_for_all(on_cpu)
    assert local_generation_endpoints(on_cpu) == []


@pytest.fixture
def listening() -> Iterator[str]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}/v1"
    finally:
        server.close()


def test_the_capture_refuses_to_start_while_the_server_answers(listening: str) -> None:
    with pytest.raises(PhaseError, match=r"still answers on this machine.*phase 2"):
        check_generation_stopped([listening])


def test_a_stopped_server_lets_the_capture_start(listening: str) -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # a port nobody listens on
    check_generation_stopped([f"http://127.0.0.1:{port}/v1"])


def test_the_dry_run_names_the_next_phase(tmp_path: Path) -> None:
    line = next_phase_line(box(), tmp_path)
    assert line.startswith("Next phase: generation of A1, B1")
    assert "http://127.0.0.1:30000/v1" in line and "capture waits" in line
    for ds in ("A1", "B1"):
        (tmp_path / f"results/responses/{ds}.jsonl").parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f"results/responses/{ds}.jsonl").touch()
    line = next_phase_line(box(), tmp_path)
    assert line.startswith("Next phase: capture of A1, B1") and "stop the generation server" in line
    for ds in ("A1", "B1"):
        (tmp_path / f"results/hidden_states/{ds}").mkdir(parents=True)
        (tmp_path / f"results/hidden_states/{ds}/manifest.json").touch()
    assert next_phase_line(box(), tmp_path).startswith("Next phase: none left")
