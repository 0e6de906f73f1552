"""The trainers' own code over our exports: one real-model run per session, shared.

The exports are made by the workflow from the real demo model (SmolLM2-135M, greedy, states
in float32 as the CPU demo computes them), so the teacher each trainer computes from them
can be held to the agreement our manifest measured.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.exported_run import DATASET, ExportedRun
from support.workflow import new_workflow, sharegpt_prompts, write_prompts


@pytest.fixture(scope="session")
def exported_run(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> ExportedRun:
    base = tmp_path_factory.mktemp("trainers")
    prompts = write_prompts(base / f"{DATASET}.jsonl", sharegpt_prompts(6))
    wf = new_workflow(
        base,
        smollm2_dir,
        {DATASET: {"path": str(prompts), "format": "sharegpt"}},
        generation={
            "batch_size": 6,
            "progress_interval_s": 0,
            "sampling": {"temperature": 0.0, "max_tokens": 48},
        },
        hidden_states={"dtype": "float32", "max_seq_len": 1024, "batch_tokens": 2048},
        validate={"agreement": {"enabled": True, "positions_per_shard": "all"}},
        draft_vocab={"size": 256},
        export={"specforge": True},
    )
    wf.run(timeout=900)
    manifest = json.loads(wf.path(f"results/hidden_states/{DATASET}/manifest.json").read_text())
    return ExportedRun(wf, smollm2_dir, manifest)
