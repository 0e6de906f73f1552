"""Snakemake script: train a small EAGLE-3 draft on the shards, against three controls."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent / "src"))

from eagle3data.consumers.draft_check import draft_check
from eagle3data.jobs import run_step

run_step(
    snakemake.log[0],
    draft_check,
    shard_dirs=[str(Path(m).parent) for m in snakemake.input.manifests],
    draft_vocab=snakemake.input.draft_vocab,
    model_dir=str(Path(snakemake.input.model).parent),
    out=snakemake.output.summary,
    settings=dict(snakemake.params.settings),
    num_threads=snakemake.threads,
    trust_remote_code=bool(snakemake.params.trust_remote_code),
)
