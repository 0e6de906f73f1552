rule tokenize:
    input:
        responses=rules.generate.output.responses,
        model=model_config_file(),
    output:
        tokenized=layout.TOKENIZED,
        stats=layout.TOKENIZE_STATS,
    log:
        "logs/tokenize/{dataset}.log",
    conda:
        "../envs/torch.yaml"
    params:
        settings=TOKENIZE_SETTINGS,
    script:
        "../scripts/tokenize.py"
