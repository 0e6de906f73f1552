# EAGLE-3 training data: prompts -> responses -> tokenized -> hidden-state shards.
# See README.md for usage and docs/reference/outputs.md for the files; logic lives in
# src/eagle3data.


configfile: "config/config.yaml"


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/model.smk"
include: "rules/prompts.smk"
include: "rules/generate.smk"
include: "rules/tokenize.smk"
include: "rules/hidden_states.smk"
include: "rules/consumers.smk"
include: "rules/draft_check.smk"
include: "rules/report.smk"


rule all:
    default_target: True
    input:
        all_targets,


# Phase 1 on a GPU box (docs/runbook.md): every dataset's responses, while the
# generation server runs; then stop it and run `snakemake` (phase 2: the capture).
rule generation:
    input:
        expand(rules.generate.output.responses, dataset=DATASETS),
    localrule: True
