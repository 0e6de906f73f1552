"""Generation, then capture, in the DAG itself: with a capture on GPUs it shares with
generation, no dataset's capture plan (and so none of its shard jobs) can start before
every dataset is tokenized; with GPUs of its own, each dataset's capture follows its own
tokenization only. Read from the dry run of one dataset's capture plan."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from support.workflow import Workflow, sharegpt_prompts, write_prompts


def planned_datasets(wf: Workflow, target: str) -> set[str]:
    """Datasets with a job in the dry run of ``target``."""
    proc = wf.run("-n", target)
    return set(re.findall(r"wildcards: dataset=(\w+)", proc.stdout + proc.stderr))


@pytest.mark.parametrize("shared", [True, False])
def test_the_capture_of_a_dataset_waits_for_every_datasets_tokenization(
    make_workflow: Callable[..., Workflow], tmp_path: Path, shared: bool
) -> None:
    prompts = write_prompts(tmp_path / "prompts.jsonl", sharegpt_prompts(2))
    wf = make_workflow(
        {ds: {"path": str(prompts), "format": "sharegpt"} for ds in ("A1", "B1")},
        gpus={"count": 1},
        generation={"backend": "openai", "endpoints": ["http://127.0.0.1:9/v1"]},
        hidden_states={"device": "cuda", "share_gpus_with_generation": shared},
    )
    expected = {"A1", "B1"} if shared else {"A1"}
    assert planned_datasets(wf, "results/hidden_states/A1/plan.json") == expected
