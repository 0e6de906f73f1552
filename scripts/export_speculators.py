"""Snakemake script: every dataset's validated shards as one vLLM speculators training folder."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent / "src"))

from eagle3data.consumers.requirements import require_speculators_export
from eagle3data.consumers.speculators import export_speculators
from eagle3data.jobs import run_step


def export_speculators_checked(**kwargs):
    """The export, after importing what its self-check imports: a missing package is
    named before the folder is written, not after."""
    require_speculators_export()
    export_speculators(**kwargs)


run_step(
    snakemake.log[0],
    export_speculators_checked,
    datasets=list(snakemake.params.datasets),
    shard_dirs=[str(Path(m).parent) for m in snakemake.input.manifests],
    responses=list(snakemake.input.responses),
    model_path=str(Path(snakemake.input.model).parent),
    draft_vocab=snakemake.input.draft_vocab,
    out_dir=snakemake.output.directory,
    work_dir=snakemake.params.work_dir,
    dtype=snakemake.params.dtype,
    seed=snakemake.params.seed,
    trust_remote_code=bool(snakemake.params.trust_remote_code),
)
