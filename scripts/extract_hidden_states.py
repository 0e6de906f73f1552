"""Snakemake script: forward pass over one shard's conversations, written as HDF5."""

# Everything is guarded, the path set-up included: the sglang backend starts worker processes
# with the spawn method, which re-runs this file in each of them as __mp_main__, where
# Snakemake's `snakemake` object does not exist (a NameError there killed SGLang's scheduler
# before it started: seen with sglang 0.5.23's CPU engine).
if __name__ == "__main__":
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(snakemake.scriptdir).parent / "src"))

    from eagle3data.config import model_name
    from eagle3data.gpu_slots import GpuRequest
    from eagle3data.hidden_states.capture_service import capture_with_engine, uses_engine_service
    from eagle3data.hidden_states.phases import check_generation_stopped, local_generation_endpoints
    from eagle3data.hidden_states.settings import CaptureSettings, execution_settings
    from eagle3data.hidden_states.shard_job import ShardJob
    from eagle3data.jobs import run_step

    # What changes the states from params (the rerun trigger); how to run them (GPUs,
    # SGLang's engine options) from the config: neither of those changes the states.
    capture = CaptureSettings.parse(
        json.loads(snakemake.params.settings), execution_settings(snakemake.config)
    )
    gpus = GpuRequest.of_job(snakemake)
    # The target loads once per run (a capture engine serves every shard job: the
    # capture_service module), unless hidden_states.engine_lifetime is "shard".
    shared = uses_engine_service(capture)
    if shared:
        step = capture_with_engine  # the engine reads and writes: no polars or h5py here
    else:
        from eagle3data.hidden_states.extraction import extract_shard  # imports no torch

        step = extract_shard
    run_step(
        snakemake.log[0],
        step,
        gpus=None if shared else gpus,
        # Phase 2 only: not while a generation server on this machine holds the GPUs.
        checks=[lambda: check_generation_stopped(local_generation_endpoints(snakemake.config))],
        **({"job_gpus": gpus} if shared else {}),
        job=ShardJob(
            dataset=snakemake.wildcards.dataset,
            shard=int(snakemake.wildcards.shard),
            spec_path=snakemake.input.spec,
            tokenized_path=snakemake.input.tokenized,
            tokenize_stats_path=snakemake.input.tokenize_stats,
            out_shard=snakemake.output.shard,
            model_path=str(Path(snakemake.input.model).parent),
            # A provenance label: read from the config, not params (rerun triggers).
            model_label=model_name(snakemake.config["model"]),
        ),
        capture=capture,
        threads=snakemake.threads,
    )
