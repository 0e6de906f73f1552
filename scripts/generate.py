"""Snakemake script: budget-capped regeneration of one dataset's responses."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent / "src"))

from eagle3data.generation.settings import GenerationSettings, execution_settings
from eagle3data.generation.stage import generate  # imports no torch
from eagle3data.gpu_slots import GpuRequest
from eagle3data.jobs import run_step

run_step(
    snakemake.log[0],
    generate,
    gpus=GpuRequest.of_job(snakemake),
    dataset=snakemake.wildcards.dataset,
    settings=GenerationSettings.parse(
        json.loads(snakemake.params.settings),
        # How to run (device, servers, concurrency, error limits): read from the config,
        # not params, which are rerun triggers: moving a run to other servers redoes nothing.
        execution_settings(snakemake.config),
    ),
    token_budget=snakemake.params.token_budget,
    max_samples=snakemake.params.max_samples,
    prompts_path=snakemake.input.prompts,
    skipped_path=snakemake.input.skipped,
    images_path=snakemake.input.images,
    out_responses=snakemake.output.responses,
    out_stats=snakemake.output.stats,
    out_errors=snakemake.output.errors,
    out_records=snakemake.output.records,
    threads=snakemake.threads,
)
