from eagle3data.gpu_slots import job_gpus


rule generate:
    input:
        prompts="results/prompts/{dataset}.parquet",
        skipped="results/prompts/{dataset}.skipped.jsonl",
        model=model_config_file(),
    output:
        responses="results/responses/{dataset}.jsonl",
        stats="results/responses/{dataset}.stats.json",
        errors="results/responses/{dataset}.errors.jsonl",
    log:
        "logs/generate/{dataset}.log",
    conda:
        "../envs/torch.yaml"
    threads: workflow.cores
    resources:
        # GPUs this job takes (0 on CPU and for the openai backend); see gpu_slots.
        gpu=job_gpus(config, "generation"),
    params:
        settings=generation_params,
        token_budget=dataset_token_budget,
        max_samples=dataset_max_samples,
        work_dir=WORK_DIR,
    script:
        "../scripts/generate.py"
