"""Snakemake script: the EAGLE-3 draft vocabulary (d2t/t2d) over all datasets."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent / "src"))

from eagle3data.steps import run_step
from eagle3data.vocab import build_draft_vocab

run_step(
    snakemake.log[0],
    build_draft_vocab,
    datasets=list(snakemake.params.datasets),
    tokenized_paths=list(snakemake.input.tokenized),
    model_path=snakemake.config["model"]["path"],
    size=snakemake.params.size,
    out_mapping=snakemake.output.mapping,
    out_summary=snakemake.output.summary,
)
