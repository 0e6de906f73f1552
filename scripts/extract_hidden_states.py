"""Snakemake script: forward pass over one shard's conversations, written as HDF5."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent / "src"))

# Guarded: the sglang backend starts worker processes with the spawn method, which
# re-imports this file in each of them.
if __name__ == "__main__":
    from eagle3data.gpu_slots import acquire_for_snakemake_job
    from eagle3data.settings import model_name
    from eagle3data.steps import extract_shard, run_step, setup_logging  # no torch yet

    setup_logging(snakemake.log[0])
    # Before anything imports torch or sglang: CUDA reads CUDA_VISIBLE_DEVICES once.
    gpu_lease = acquire_for_snakemake_job(snakemake)

    run_step(
        snakemake.log[0],
        extract_shard,
        dataset=snakemake.wildcards.dataset,
        shard=int(snakemake.wildcards.shard),
        spec_path=snakemake.input.spec,
        tokenized_path=snakemake.input.tokenized,
        tokenize_stats_path=snakemake.input.tokenize_stats,
        model_path=snakemake.config["model"]["path"],
        model_label=model_name(snakemake.config["model"]),
        hidden_cfg=snakemake.config["hidden_states"],
        model_dtype=snakemake.config["model"]["dtype"],
        out_shard=snakemake.output.shard,
        threads=snakemake.threads,
    )
