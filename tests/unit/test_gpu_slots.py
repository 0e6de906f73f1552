"""Per-GPU slot locks, with a fake GPU count (no GPU needed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.settings import validated_config
from support.workflow import REPO

from eagle3data import gpu_slots
from eagle3data.gpu_slots import (
    GpuRequest,
    GpuSlotError,
    GpuSlotTimeout,
    acquire_gpus,
    detect_gpu_count,
    job_gpus,
    resolve_gpus_per_job,
)

ORIGINAL_VISIBLE = os.environ.get("CUDA_VISIBLE_DEVICES")  # as pytest started

SRC = str(REPO / "src")

# A job holding `count` of `total` fake GPUs: prints what it got, then waits for stdin.
HOLDER = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {src!r})
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    from eagle3data.gpu_slots import acquire_gpus
    acquire_gpus(int(sys.argv[1]), lock_dir=sys.argv[2], total=int(sys.argv[3]),
                 timeout_s=float(sys.argv[4]), poll_s=0.05)
    print(os.environ["CUDA_VISIBLE_DEVICES"], flush=True)
    sys.stdin.readline()
    """
).format(src=SRC)


class Holder:
    def __init__(self, lock_dir: Path, count: int, total: int, timeout_s: float = 10) -> None:
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(count), str(lock_dir), str(total), str(timeout_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )

    def devices(self) -> list[str]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line:
            raise AssertionError(f"holder got no GPU: {self.proc.stderr.read()}")  # type: ignore[union-attr]
        return line.split(",")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture(autouse=True)
def fresh_leases(monkeypatch):
    """Leases taken in this test process stay out of other tests."""
    monkeypatch.setattr(gpu_slots, "_HELD", [])


@pytest.fixture
def held():
    holders: list[Holder] = []
    leases: list[gpu_slots.GpuLease] = []
    yield holders, leases
    for h in holders:
        h.stop()
    for lease in leases:
        lease.release()


def test_two_processes_never_share_a_gpu(tmp_path, held):
    holders, _ = held
    holders += [Holder(tmp_path, 1, 3) for _ in range(3)]
    got = [h.devices() for h in holders]
    assert sorted(d for ids in got for d in ids) == ["0", "1", "2"]


def test_multi_gpu_jobs_get_disjoint_sets(tmp_path, held):
    holders, _ = held
    holders += [Holder(tmp_path, 2, 4), Holder(tmp_path, 2, 4)]
    first, second = (set(h.devices()) for h in holders)
    assert len(first) == len(second) == 2
    assert not first & second


def test_a_killed_holder_frees_its_gpu(tmp_path, held):
    holders, leases = held
    holder = Holder(tmp_path, 1, 1)
    holders.append(holder)
    assert holder.devices() == ["0"]
    env: dict[str, str] = {}
    with pytest.raises(GpuSlotTimeout):
        acquire_gpus(1, lock_dir=tmp_path, total=1, timeout_s=0.2, poll_s=0.05, env=env)
    holder.proc.send_signal(signal.SIGKILL)
    holder.proc.wait(timeout=10)
    lease = acquire_gpus(1, lock_dir=tmp_path, total=1, timeout_s=5, poll_s=0.05, env=env)
    leases.append(lease)
    assert lease is not None and lease.device_ids == ("0",)
    assert env["CUDA_VISIBLE_DEVICES"] == "0"


def test_timeout_message_names_the_holders_and_the_fix(tmp_path, held):
    holders, _ = held
    holder = Holder(tmp_path, 2, 2)
    holders.append(holder)
    holder.devices()
    with pytest.raises(GpuSlotTimeout) as err:
        acquire_gpus(1, lock_dir=tmp_path, total=2, timeout_s=0.3, poll_s=0.05, env={})
    message = str(err.value)
    assert "waited 0 s for 1 of 2 GPUs" in message
    assert f"GPU 0: pid {holder.proc.pid}" in message
    assert f"GPU 1: pid {holder.proc.pid}" in message
    assert "--resources gpu=2" in message


def test_a_job_never_holds_part_of_what_it_needs_while_waiting(tmp_path, held):
    holders, leases = held
    holder = Holder(tmp_path, 1, 2)
    holders.append(holder)
    (taken,) = holder.devices()
    with pytest.raises(GpuSlotTimeout):
        acquire_gpus(2, lock_dir=tmp_path, total=2, timeout_s=0.2, poll_s=0.05, env={})
    # The free GPU was let go again: another job takes it at once.
    lease = acquire_gpus(1, lock_dir=tmp_path, total=2, timeout_s=0, env={})
    leases.append(lease)
    assert lease is not None and lease.device_ids == (str(1 - int(taken)),)


def test_a_waiting_job_gets_the_gpu_when_it_is_freed(tmp_path, held):
    holders, _ = held
    first = Holder(tmp_path, 1, 1)
    holders.append(first)
    assert first.devices() == ["0"]
    second = Holder(tmp_path, 1, 1, timeout_s=30)
    holders.append(second)
    first.stop()
    assert second.devices() == ["0"]


def test_scheduler_assigned_devices_are_respected(tmp_path):
    env = {"CUDA_VISIBLE_DEVICES": "3,5"}
    lease = acquire_gpus(2, lock_dir=tmp_path / "locks", total=8, env=env)
    assert lease is not None and lease.assigned_by_scheduler
    assert lease.device_ids == ("3", "5")
    assert env["CUDA_VISIBLE_DEVICES"] == "3,5"
    assert not (tmp_path / "locks").exists()  # no lock taken
    with pytest.raises(GpuSlotError, match=r"needs 3 GPU\(s\) but CUDA_VISIBLE_DEVICES='3,5'"):
        acquire_gpus(3, lock_dir=tmp_path, env=env)


def test_gpus_restricted_by_hand_are_shared_by_lock(tmp_path, held):
    _, leases = held
    env = {"CUDA_VISIBLE_DEVICES": "2,5,7"}
    first = acquire_gpus(1, lock_dir=tmp_path, env=env)
    assert first is not None and not first.assigned_by_scheduler
    assert env["CUDA_VISIBLE_DEVICES"] == "2"  # narrowed to the job's GPU
    leases.append(first)
    second_env = {"CUDA_VISIBLE_DEVICES": "2,5,7"}
    second = acquire_gpus(2, lock_dir=tmp_path, env=second_env)
    leases.append(second)
    assert second is not None and second.device_ids == ("5", "7")
    assert second_env["CUDA_VISIBLE_DEVICES"] == "5,7"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu-2.lock", "gpu-5.lock", "gpu-7.lock"]


def test_cpu_jobs_take_nothing(tmp_path):
    env: dict[str, str] = {}
    assert acquire_gpus(0, lock_dir=tmp_path, total=0, env=env) is None
    assert env == {}


def test_more_gpus_than_the_machine_has_fails_at_once(tmp_path):
    with pytest.raises(GpuSlotError, match=r"needs 4 GPU\(s\) but this machine has 2"):
        acquire_gpus(4, lock_dir=tmp_path, total=2, env={})


def test_detect_gpu_count_without_torch(tmp_path, monkeypatch):
    assert detect_gpu_count({"CUDA_VISIBLE_DEVICES": "0,1,7"}) == 3
    assert detect_gpu_count({"CUDA_VISIBLE_DEVICES": ""}) == 0
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        "echo 'GPU 0: NVIDIA H200 (UUID: GPU-a)'\n"
        "echo 'GPU 1: NVIDIA H200 (UUID: GPU-b)'\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert detect_gpu_count({}) == 2
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert detect_gpu_count({}) == 0


def test_gpu_slots_does_not_import_torch():
    code = (
        f"import sys; sys.path.insert(0, {SRC!r}); import eagle3data.gpu_slots; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("setting", "device", "gpu_backend", "backend_gpus", "machine", "expected"),
    [
        ("auto", "auto", True, None, 8, 1),
        ("auto", "auto", True, None, 0, 0),
        ("auto", "cpu", True, None, 8, 0),
        ("auto", "cuda:0", True, None, 8, 1),
        ("auto", "auto", False, None, 8, 0),  # openai: the server has the GPUs
        ("auto", "auto", True, 4, 8, 4),  # sglang tp_size
        (2, "auto", True, None, 0, 2),
        (0, "cuda", True, None, 8, 0),
    ],
)
def test_resolve_gpus_per_job(setting, device, gpu_backend, backend_gpus, machine, expected):
    got = resolve_gpus_per_job(
        setting,
        device=device,
        uses_gpu_backend=gpu_backend,
        backend_gpus=backend_gpus,
        machine_gpus=machine,
    )
    assert got == expected


def test_job_gpus_from_config():
    config = {
        "gpus": {"count": 8},
        "generation": {"backend": "openai", "device": "auto", "gpus_per_job": "auto"},
        "hidden_states": {
            "backend": "sglang",
            "device": "auto",
            "gpus_per_job": "auto",
            "sglang": {"tp_size": 4},
        },
    }
    assert job_gpus(config, "generation") == 0
    assert job_gpus(config, "hidden_states") == 4
    config["hidden_states"]["gpus_per_job"] = 2
    with pytest.raises(ValueError, match=r"less than the 4 GPUs of hidden_states\.sglang"):
        job_gpus(config, "hidden_states")
    config["hidden_states"]["gpus_per_job"] = "auto"
    # Kimi-K2.5's high-throughput layout: attention in 8 groups inside the 8 GPUs.
    config["hidden_states"]["sglang"] = {"tp_size": 8, "dp_size": 8, "enable_dp_attention": True}
    assert job_gpus(config, "hidden_states") == 8
    # Without data-parallel attention, dp_size replicas of tp_size GPUs each.
    config["hidden_states"]["sglang"] = {"tp_size": 2, "dp_size": 4}
    assert job_gpus(config, "hidden_states") == 8
    config["hidden_states"].update(device="cpu", gpus_per_job="auto")
    assert job_gpus(config, "hidden_states") == 0  # SGLang's CPU engine
    config["hidden_states"].update(backend="transformers", device="auto")
    assert job_gpus(config, "hidden_states") == 1
    config["gpus"]["count"] = 0
    assert job_gpus(config, "hidden_states") == 0


def test_a_snakemake_jobs_request(tmp_path, monkeypatch):
    # setenv first, so that the value the job sets is undone after the test: delenv of
    # an absent variable records nothing to restore, and the leak made later tests of
    # this process ask SLURM for a GPU.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv(gpu_slots.LOCK_DIR_ENV, str(tmp_path))
    job = SimpleNamespace(
        resources=SimpleNamespace(gpu=2), config={"gpus": {"count": 3, "lock_timeout_s": 1}}
    )
    request = GpuRequest.of_job(job)
    assert request == GpuRequest(count=2, machine_gpus=3, timeout_s=1.0)
    lease = request.acquire()
    try:
        assert lease is not None and lease.device_ids == ("0", "1")
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu-0.lock", "gpu-1.lock"]
    finally:
        assert lease is not None
        lease.release()
    cpu_job = SimpleNamespace(resources=SimpleNamespace(gpu=0), config=validated_config())
    assert GpuRequest.of_job(cpu_job) == GpuRequest(count=0)
    assert GpuRequest.of_job(cpu_job).acquire() is None


def test_a_job_spreads_its_model_over_the_gpus_it_asked_for(tmp_path, monkeypatch, held):
    from eagle3data.hidden_states.backends import job_gpu_count

    _, leases = held
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert job_gpu_count() == 4  # no lease: all visible GPUs
    # 4 GPUs visible, the job asked for 2: device_map uses 2.
    leases.append(acquire_gpus(2, lock_dir=tmp_path, env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"}))
    assert job_gpu_count() == 2
    monkeypatch.setattr(gpu_slots, "_HELD", [])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert job_gpu_count() == 1  # CPU or the default device


def test_no_test_leaves_cuda_visible_devices_set() -> None:
    # Runs after the tests above (same module, file order): none of them may leak it.
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == ORIGINAL_VISIBLE
