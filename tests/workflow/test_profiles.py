"""The workflow profiles: the SLURM one plans the whole workflow with the executor
plugin installed (no cluster needed for a dry run)."""

from __future__ import annotations

import pytest
from support.workflow import sharegpt_prompts, write_prompts

pytestmark = pytest.mark.e2e


def _job_resources(output: str, rule: str) -> str:
    block = output.split(f"rule {rule}:", 1)[1]
    return next(line for line in block.splitlines() if line.strip().startswith("resources:"))


def test_slurm_profile_plans_every_stage(make_workflow, tmp_path) -> None:
    prompts = write_prompts(tmp_path / "A1.jsonl", sharegpt_prompts(3))
    wf = make_workflow({"A1": {"path": str(prompts), "format": "sharegpt", "token_budget": 50}})
    proc = wf.run("-n", "--workflow-profile", "profiles/slurm")
    out = proc.stdout + proc.stderr
    for rule in ("prompts", "generate", "tokenize", "plan_shards", "validate", "all"):
        assert f"rule {rule}:" in out or f"checkpoint {rule}:" in out, rule
    generate = _job_resources(out, "generate")
    assert "slurm_partition=gpu" in generate and "runtime=10080" in generate, generate
    assert "slurm_partition=cpu" in _job_resources(out, "prompts")


def test_slurm_profile_keeps_the_resume_settings_of_the_default_one() -> None:
    import yaml
    from support.workflow import REPO

    default = yaml.safe_load((REPO / "profiles/default/config.v8+.yaml").read_text())
    slurm = yaml.safe_load((REPO / "profiles/slurm/config.v8+.yaml").read_text())
    for key in ("rerun-incomplete", "rerun-triggers"):
        assert slurm[key] == default[key], key
    assert slurm["executor"] == "slurm"
