# Consumers of the shards: SpecForge export (optional) and the draft vocabulary.


rule export_specforge:
    input:
        manifest=rules.validate.output.manifest,
    output:
        directory=directory(layout.SPECFORGE),
    log:
        "logs/export_specforge/{dataset}.log",
    conda:
        "../envs/torch.yaml"
    params:
        work_dir=layout.SPECFORGE_WORK,
        dtype=lookup(dpath="export/dtype", within=config),
    script:
        "../scripts/export_specforge.py"


rule draft_vocab:
    input:
        tokenized=expand(rules.tokenize.output.tokenized, dataset=DATASETS),
        model=model_config_file(),
    output:
        mapping=layout.DRAFT_VOCAB,
        summary=layout.DRAFT_VOCAB_SUMMARY,
    log:
        "logs/draft_vocab/draft_vocab.log",
    conda:
        "../envs/torch.yaml"
    params:
        size=lookup(dpath="draft_vocab/size", within=config),
        datasets=DATASETS,
    script:
        "../scripts/draft_vocab.py"
