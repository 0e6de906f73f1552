"""Snakemake script: forward pass over one shard's conversations, written as HDF5."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent / "src"))

from eagle3data.settings import model_name
from eagle3data.steps import extract_shard, run_step

run_step(
    snakemake.log[0],
    extract_shard,
    dataset=snakemake.wildcards.dataset,
    shard=int(snakemake.wildcards.shard),
    plan_path=snakemake.input.plan,
    tokenized_path=snakemake.input.tokenized,
    tokenize_stats_path=snakemake.input.tokenize_stats,
    model_path=snakemake.config["model"]["path"],
    model_label=model_name(snakemake.config["model"]),
    hidden_cfg=snakemake.config["hidden_states"],
    model_dtype=snakemake.config["model"]["dtype"],
    out_shard=snakemake.output.shard,
    threads=snakemake.threads,
)
