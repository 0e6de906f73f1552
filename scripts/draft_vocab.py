"""Snakemake script: the EAGLE-3 draft vocabulary (d2t/t2d) over all datasets."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent / "src"))

from eagle3data.consumers.vocab import build_draft_vocab
from eagle3data.jobs import run_step

run_step(
    snakemake.log[0],
    build_draft_vocab,
    datasets=list(snakemake.params.datasets),
    tokenized_paths=list(snakemake.input.tokenized),
    model_path=str(Path(snakemake.input.model).parent),
    size=snakemake.params.size,
    out_mapping=snakemake.output.mapping,
    out_summary=snakemake.output.summary,
)
