"""Config errors stop the real workflow before any job, in one line naming the keys."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.workflow import new_workflow, sharegpt_prompts, write_prompts

from eagle3data import layout

pytestmark = pytest.mark.e2e


def test_float16_with_the_speculators_export_stops_the_workflow_before_any_job(
    tmp_path: Path,
) -> None:
    prompts = write_prompts(tmp_path / "A1.jsonl", sharegpt_prompts(2))
    # The demo model's path: the parse-time file check leaves it to the demo_model rule.
    wf = new_workflow(
        tmp_path,
        Path(layout.DEMO_MODEL),
        {"A1": {"path": str(prompts), "format": "sharegpt"}},
        export={"speculators": True, "dtype": "float16"},
    )
    # A dry run: it plans every job today (the export job would refuse float16 at the end).
    proc = wf.run("-n", check=False)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "export.dtype: float16" in lines[-1] and "export.speculators" in lines[-1], lines
    assert not [line for line in lines if line.lstrip().startswith("File ")], lines


def test_with_conda_environments_a_missing_export_package_stops_the_dry_run(
    tmp_path: Path,
) -> None:
    """``--software-deployment-method conda``: the check reads the export job's environment
    file (envs/torch.yaml lists no speculators), not this process's packages."""
    prompts = write_prompts(tmp_path / "A1.jsonl", sharegpt_prompts(2))
    wf = new_workflow(
        tmp_path,
        Path(layout.DEMO_MODEL),
        {"A1": {"path": str(prompts), "format": "sharegpt"}},
        export={"speculators": True},
    )
    assert wf.run("-n", check=False).returncode == 0  # installed in this environment
    proc = wf.run("-n", "--software-deployment-method", "conda", check=False)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "export.speculators: true needs speculators" in lines[-1], lines
    assert "conda environment (torch.yaml)" in lines[-1], lines
