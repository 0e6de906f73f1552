from eagle3data.gpu_slots import job_gpus


checkpoint plan_shards:
    input:
        unpack(plan_shards_input),
    output:
        plan="results/hidden_states/{dataset}/plan.json",
    log:
        "logs/plan_shards/{dataset}.log",
    conda:
        "../envs/torch.yaml"
    params:
        settings=hidden_state_params,
        spec_dir=f"{WORK_DIR}/shards/{{dataset}}",
    script:
        "../scripts/plan_shards.py"


# A shard re-runs when its spec changes (plan_shards rewrites only changed specs), not
# whenever the dataset's files do: raising a budget extracts only new or changed shards.
rule hidden_states:
    input:
        spec=f"{WORK_DIR}/shards/{{dataset}}/shard-{{shard}}.json",
        plan=ancient("results/hidden_states/{dataset}/plan.json"),
        tokenized=ancient("results/tokenized/{dataset}.parquet"),
        tokenize_stats=ancient("results/tokenized/{dataset}.stats.json"),
        model=model_config_file(),
    output:
        shard="results/hidden_states/{dataset}/shard-{shard}.h5",
    log:
        "logs/hidden_states/{dataset}/shard-{shard}.log",
    conda:
        "../envs/torch.yaml"
    threads: workflow.cores
    resources:
        # GPUs this job takes (0 on CPU); the job picks which by lock (gpu_slots).
        gpu=job_gpus(config, "hidden_states"),
    params:
        settings=hidden_state_params,
    script:
        "../scripts/extract_hidden_states.py"


rule validate:
    input:
        shards=shard_files,
        plan="results/hidden_states/{dataset}/plan.json",
        responses="results/responses/{dataset}.jsonl",
        tokenized="results/tokenized/{dataset}.parquet",
        tokenize_stats="results/tokenized/{dataset}.stats.json",
    output:
        manifest="results/hidden_states/{dataset}/manifest.json",
    log:
        "logs/validate/{dataset}.log",
    conda:
        "../envs/data.yaml"
    script:
        "../scripts/validate_shards.py"
