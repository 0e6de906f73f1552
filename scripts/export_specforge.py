"""Snakemake script: one dataset's validated shards as SpecForge offline feature files."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent / "src"))

from eagle3data.consumers.specforge import export_specforge
from eagle3data.jobs import run_step

run_step(
    snakemake.log[0],
    export_specforge,
    dataset=snakemake.wildcards.dataset,
    shard_dir=str(Path(snakemake.input.manifest).parent),
    model_path=str(Path(snakemake.input.model).parent),
    out_dir=snakemake.output.directory,
    work_dir=snakemake.params.work_dir,
    dtype=snakemake.params.dtype,
    trust_remote_code=bool(snakemake.params.trust_remote_code),
)
