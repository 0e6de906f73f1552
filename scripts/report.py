"""Snakemake script: the run's pictures (results/report/*.png) and summary.html."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent / "src"))

from eagle3data.jobs import run_step
from eagle3data.monitor.report import FIGURES, build_report

run_step(
    snakemake.log[0],
    build_report,
    datasets=list(snakemake.params.datasets),
    responses=list(snakemake.input.responses),
    response_stats=list(snakemake.input.response_stats),
    records=list(snakemake.input.records),
    tokenize_stats=list(snakemake.input.tokenize_stats),
    plans=list(snakemake.input.plans),
    manifests=list(snakemake.input.manifests),
    shard_bytes=snakemake.params.shard_bytes,
    out_images={name: snakemake.output[name] for name in FIGURES},
    out_summary=snakemake.output.summary,
)
