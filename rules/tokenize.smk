rule tokenize:
    input:
        responses="results/responses/{dataset}.jsonl",
        model=model_config_file(),
    output:
        tokenized="results/tokenized/{dataset}.parquet",
        stats="results/tokenized/{dataset}.stats.json",
    log:
        "logs/tokenize/{dataset}.log",
    conda:
        "../envs/torch.yaml"
    params:
        settings=tokenize_params,
    script:
        "../scripts/tokenize.py"
