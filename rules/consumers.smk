# Consumers of the shards: SpecForge export (optional) and the draft vocabulary.


rule export_specforge:
    input:
        manifest="results/hidden_states/{dataset}/manifest.json",
    output:
        directory=directory("results/specforge/{dataset}"),
    log:
        "logs/export_specforge/{dataset}.log",
    conda:
        "../envs/torch.yaml"
    params:
        work_dir=f"{WORK_DIR}/specforge",
    script:
        "../scripts/export_specforge.py"


rule draft_vocab:
    input:
        tokenized=expand("results/tokenized/{dataset}.parquet", dataset=DATASETS),
        model=model_config_file(),
    output:
        mapping="results/vocab/draft_vocab.pt",
        summary="results/vocab/draft_vocab.json",
    log:
        "logs/draft_vocab/draft_vocab.log",
    conda:
        "../envs/torch.yaml"
    params:
        size=config["draft_vocab"]["size"],
        datasets=DATASETS,
    script:
        "../scripts/draft_vocab.py"
