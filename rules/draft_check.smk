# A draft trained on the shards against three controls (off by default: draft_check.enabled).
# results/draft_check/summary.json: see src/eagle3data/consumers/draft_check.py.


rule draft_check:
    input:
        manifests=expand(rules.validate.output.manifest, dataset=DATASETS),
        draft_vocab=rules.draft_vocab.output.mapping,
        model=model_config_file(),
    output:
        summary=layout.DRAFT_CHECK,
    log:
        "logs/draft_check/draft_check.log",
    conda:
        "../envs/torch.yaml"
    threads: lookup(dpath="draft_check/threads", within=config)
    params:
        # What the check trains and measures (not `enabled` or `threads`).
        settings={k: v for k, v in config["draft_check"].items() if k not in ("enabled", "threads")},
        trust_remote_code=lookup(dpath="model/trust_remote_code", within=config),
    script:
        "../scripts/draft_check.py"
