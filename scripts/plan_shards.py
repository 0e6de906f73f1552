"""Snakemake checkpoint script: split a dataset's tokens into bounded shards."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent / "src"))

from eagle3data.hidden_states.planning import plan_shards
from eagle3data.hidden_states.settings import CaptureSettings, execution_settings
from eagle3data.jobs import run_step

capture = CaptureSettings.parse(
    json.loads(snakemake.params.settings), execution_settings(snakemake.config)
)
run_step(
    snakemake.log[0],
    plan_shards,
    dataset=snakemake.wildcards.dataset,
    tokenized_path=snakemake.input.tokenized,
    tokenize_stats_path=snakemake.input.tokenize_stats,
    model_path=str(Path(snakemake.input.model).parent),
    capture=capture,
    out_plan=snakemake.output.plan,
    spec_dir=snakemake.params.spec_dir,
)
