rule prompts:
    input:
        source=dataset_source,
    output:
        prompts=layout.PROMPTS,
        skipped=layout.SKIPPED_PROMPTS,
        images=layout.PROMPT_IMAGES,
    log:
        "logs/prompts/{dataset}.log",
    conda:
        "../envs/data.yaml"
    params:
        path=lookup(dpath="datasets/{dataset}/path", within=config),
        split=lookup(dpath="datasets/{dataset}/split", within=config),
        fields=lookup(dpath="datasets/{dataset}/fields", within=config),
        min_valid_share=lookup(dpath="datasets/{dataset}/min_valid_share", within=config),
        fmt=lookup(dpath="datasets/{dataset}/format", within=config),
        on_invalid=lookup(dpath="datasets/{dataset}/on_invalid", within=config),
        shuffle_seed=lookup(dpath="prompts/shuffle_seed", within=config),
    script:
        "../scripts/prepare_prompts.py"
