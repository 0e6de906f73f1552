"""The SLURM profile on a real SLURM: a small part of the workflow is submitted with
sbatch through snakemake-executor-plugin-slurm and polled with squeue.

Needs a running SLURM whose partitions include the profile's placeholders "cpu" and
"gpu"; as root, `tests/slurm/start_single_node.sh` starts such a one-node cluster here
(Debian's slurm-wlm + munge, no accounting). Skipped when there is none."""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any

import pytest
import yaml
from support.workflow import REPO, sharegpt_prompts, write_prompts

pytestmark = pytest.mark.e2e

NEEDS_SLURM = "needs a running SLURM (tests/slurm/start_single_node.sh)"
# Small enough for a 2-core node; everything else (partitions, account, requeue,
# kept logs, ...) comes from the profile unchanged.
SMALL = {"runtime": 10, "mem_mb": 1000, "cpus_per_task": 1}


def _slurm_partitions() -> set[str]:
    """Partitions with a usable node, or an empty set when no SLURM answers."""
    if shutil.which("sinfo") is None:
        return set()
    try:
        proc = subprocess.run(
            ["sinfo", "--noheader", "--format=%R %T"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired):
        return set()
    if proc.returncode != 0:
        return set()
    usable = ("idle", "mixed", "allocated", "completing")
    return {
        part
        for part, state in (line.split() for line in proc.stdout.splitlines() if line.strip())
        if state.rstrip("*~#!%$@^-+").startswith(usable)
    }


def _resource_args(profile: dict[str, Any]) -> list[str]:
    """The profile's resources with SMALL sizes. On the command line --default-resources
    and --set-resources replace the profile's mappings as a whole, so both are repeated."""
    defaults = {**profile["default-resources"], **SMALL}
    args = ["--default-resources", *(f"{k}={v}" for k, v in defaults.items())]
    args.append("--set-resources")
    for rule, resources in profile["set-resources"].items():
        args += [f"{rule}:{k}={v}" for k, v in {**resources, **SMALL}.items()]
    return args


def _squeue(job_ids: list[str]) -> dict[str, tuple[str, str, str]]:
    """job id -> (partition, state, account) of finished and running jobs."""
    proc = subprocess.run(
        ["squeue", "--states=all", "--noheader", "--format=%i|%P|%T|%a", "-j", ",".join(job_ids)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    rows = (line.split("|") for line in proc.stdout.splitlines() if line.strip())
    return {job: (partition, state, account) for job, partition, state, account in rows}


@pytest.fixture(scope="session")  # session: checked before the tiny model is built
def slurm_cluster() -> None:
    """Skips unless SLURM answers with the profile's partitions."""
    if not {"cpu", "gpu"} <= _slurm_partitions():
        pytest.skip(NEEDS_SLURM)


def test_slurm_profile_runs_jobs_on_a_real_cluster(slurm_cluster, make_workflow, tmp_path) -> None:
    profile = yaml.safe_load((REPO / "profiles/slurm/config.v8+.yaml").read_text())
    prompts = write_prompts(tmp_path / "A1.jsonl", sharegpt_prompts(3))
    wf = make_workflow({"A1": {"path": str(prompts), "format": "sharegpt", "token_budget": 50}})

    target = "results/responses/A1.jsonl"  # prompts (cpu partition) + generate (gpu)
    proc = wf.run(
        target,
        "--workflow-profile",
        "profiles/slurm",
        # No accounting database here: sacct fails, squeue sees ended jobs (MinJobAge).
        "--slurm-status-command",
        "squeue",
        "--slurm-init-seconds-before-status-checks",
        "1",
        *_resource_args(profile),
        timeout=900,
    )
    out = proc.stdout + proc.stderr

    assert len(wf.responses("A1")) == 3
    submitted = dict(re.findall(r"log: \S*/slurm_logs/rule_(\w+)/\S*/(\d+)\.log\)", out))
    assert set(submitted) == {"prompts", "generate"}, out[-4000:]
    for rule, job_id in submitted.items():
        # --slurm-keep-successful-logs (profile) keeps the job's SLURM log.
        log = wf.path(f".snakemake/slurm_logs/rule_{rule}/A1/{job_id}.log")
        assert "--executor slurm-jobstep" in log.read_text(), rule
    jobs = _squeue(list(submitted.values()))
    account = profile["default-resources"]["slurm_account"]
    assert jobs[submitted["prompts"]] == ("cpu", "COMPLETED", account)
    assert jobs[submitted["generate"]] == ("gpu", "COMPLETED", account)
    assert wf.plans_nothing(target)
