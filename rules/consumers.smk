# Consumers of the shards: the SpecForge and speculators exports (optional) and the draft vocabulary.


rule export_specforge:
    input:
        manifest=rules.validate.output.manifest,
        model=model_config_file(),
    output:
        directory=directory(layout.SPECFORGE),
    log:
        "logs/export_specforge/{dataset}.log",
    conda:
        "../envs/torch.yaml"
    params:
        work_dir=layout.SPECFORGE_WORK,
        dtype=lookup(dpath="export/dtype", within=config),
        trust_remote_code=lookup(dpath="model/trust_remote_code", within=config),
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


rule export_speculators:
    input:
        manifests=expand(rules.validate.output.manifest, dataset=DATASETS),
        responses=expand(rules.generate.output.responses, dataset=DATASETS),
        draft_vocab=rules.draft_vocab.output.mapping,
        model=model_config_file(),
    output:
        directory=directory(layout.SPECULATORS),
    log:
        "logs/export_speculators/export_speculators.log",
    conda:
        "../envs/torch.yaml"
    params:
        work_dir=layout.SPECULATORS_WORK,
        datasets=DATASETS,
        dtype=lookup(dpath="export/dtype", within=config),
        seed=lookup(dpath="prompts/shuffle_seed", within=config),
        trust_remote_code=lookup(dpath="model/trust_remote_code", within=config),
    script:
        "../scripts/export_speculators.py"
