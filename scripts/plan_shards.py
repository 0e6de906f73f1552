"""Snakemake checkpoint script: split a dataset's tokens into bounded shards."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent / "src"))

from eagle3data.steps import plan_shards, run_step

run_step(
    snakemake.log[0],
    plan_shards,
    dataset=snakemake.wildcards.dataset,
    tokenized_path=snakemake.input.tokenized,
    tokenize_stats_path=snakemake.input.tokenize_stats,
    model_path=snakemake.config["model"]["path"],
    hidden_cfg=snakemake.config["hidden_states"],
    model_dtype=snakemake.config["model"]["dtype"],
    out_plan=snakemake.output.plan,
    spec_dir=snakemake.params.spec_dir,
)
