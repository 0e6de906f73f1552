checkpoint plan_shards:
    input:
        unpack(plan_shards_input),
    output:
        plan=layout.SHARD_PLAN,
    log:
        "logs/plan_shards/{dataset}.log",
    conda:
        "../envs/torch.yaml"
    params:
        settings=HIDDEN_STATE_SETTINGS,
        spec_dir=layout.SHARD_SPEC_DIR,
    script:
        "../scripts/plan_shards.py"


# A shard re-runs when its spec changes (plan_shards rewrites only changed specs), not
# whenever the dataset's files do: raising a budget extracts only new or changed shards.
# (Patterns, not rules.<rule>.output: ancient() flags the very object it is given.)
rule hidden_states:
    input:
        spec=layout.SHARD_SPEC,
        plan=ancient(layout.SHARD_PLAN),
        tokenized=ancient(layout.TOKENIZED),
        tokenize_stats=ancient(layout.TOKENIZE_STATS),
        # Not the dataset's image table: the job finds it in the workflow's layout (it
        # exists with the tokenized table), since a new input would redo every shard of
        # an earlier run.
        model=model_config_file(),
    output:
        shard=layout.SHARD,
    log:
        "logs/hidden_states/{dataset}/shard-{shard}.log",
    conda:
        "../envs/torch.yaml"
    threads: workflow.cores
    resources:
        # GPUs this job takes (0 on CPU); the job picks which by lock (gpu_slots).
        gpu=job_gpus(config, "hidden_states"),
    params:
        settings=HIDDEN_STATE_SETTINGS,
    script:
        "../scripts/extract_hidden_states.py"


rule validate:
    input:
        shards=shard_files,
        plan=rules.plan_shards.output.plan,
        responses=rules.generate.output.responses,
        tokenized=rules.tokenize.output.tokenized,
        tokenize_stats=rules.tokenize.output.stats,
        # The target's head and eos ids, for the agreement check.
        model=model_config_file(),
    output:
        manifest=layout.MANIFEST,
    log:
        "logs/validate/{dataset}.log",
    conda:
        "../envs/torch.yaml"
    params:
        checks={
            "aux_layers": config["hidden_states"]["aux_layers"],
            "aux_layer_convention": config["hidden_states"]["aux_layer_convention"],
            "agreement": config["validate"]["agreement"],
            "retokenize_samples": config["validate"]["retokenize_samples"],
            "tokenize": tokenize_settings(config),
            "trust_remote_code": config["model"]["trust_remote_code"],
        },
    script:
        "../scripts/validate_shards.py"
