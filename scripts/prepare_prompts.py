"""Snakemake script: normalise one prompt source to results/prompts/{dataset}.parquet."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent / "src"))

from eagle3data.jobs import run_step
from eagle3data.prompts.stage import prepare_prompts

run_step(
    snakemake.log[0],
    prepare_prompts,
    dataset=snakemake.wildcards.dataset,
    source=snakemake.params.path,
    split=snakemake.params.split,
    fields=snakemake.params.fields,
    min_valid_share=snakemake.params.min_valid_share,
    fmt=snakemake.params.fmt,
    on_invalid=snakemake.params.on_invalid,
    shuffle_seed=snakemake.params.shuffle_seed,
    out_prompts=snakemake.output.prompts,
    out_skipped=snakemake.output.skipped,
    out_images=snakemake.output.images,
)
