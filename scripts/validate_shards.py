"""Snakemake script: check every shard of a dataset (and the target's agreement with
its tokens) and write manifest.json."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent / "src"))

from eagle3data.hidden_states.validation import ValidationSettings, validate
from eagle3data.jobs import run_step

run_step(
    snakemake.log[0],
    validate,
    dataset=snakemake.wildcards.dataset,
    responses_path=snakemake.input.responses,
    tokenized_path=snakemake.input.tokenized,
    tokenize_stats_path=snakemake.input.tokenize_stats,
    plan_path=snakemake.input.plan,
    shard_paths=list(snakemake.input.shards),
    out_manifest=snakemake.output.manifest,
    model_path=str(Path(snakemake.input.model).parent),
    settings=ValidationSettings.parse(snakemake.params.checks),
)
