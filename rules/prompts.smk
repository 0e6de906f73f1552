rule prompts:
    input:
        source=dataset_source,
    output:
        prompts="results/prompts/{dataset}.parquet",
        skipped="results/prompts/{dataset}.skipped.jsonl",
    log:
        "logs/prompts/{dataset}.log",
    conda:
        "../envs/data.yaml"
    params:
        fmt=dataset_format,
        on_invalid=dataset_on_invalid,
        shuffle_seed=config["prompts"]["shuffle_seed"],
    script:
        "../scripts/prepare_prompts.py"
