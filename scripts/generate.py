"""Snakemake script: budget-capped regeneration of one dataset's responses."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent / "src"))

from eagle3data.gpu_slots import acquire_for_snakemake_job
from eagle3data.steps import generate, run_step, setup_logging  # no torch import yet

setup_logging(snakemake.log[0])
# Before anything imports torch: CUDA reads CUDA_VISIBLE_DEVICES once.
gpu_lease = acquire_for_snakemake_job(snakemake)

run_step(
    snakemake.log[0],
    generate,
    dataset=snakemake.wildcards.dataset,
    config=snakemake.config,
    prompts_path=snakemake.input.prompts,
    skipped_path=snakemake.input.skipped,
    work_dir=snakemake.params.work_dir,
    out_responses=snakemake.output.responses,
    out_stats=snakemake.output.stats,
    out_errors=snakemake.output.errors,
    threads=snakemake.threads,
)
