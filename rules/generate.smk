from eagle3data.generation.engines import is_streaming


rule generate:
    input:
        prompts=rules.prompts.output.prompts,
        skipped=rules.prompts.output.skipped,
        images=rules.prompts.output.images,
        model=model_config_file(),
    output:
        responses=layout.RESPONSES,
        stats=layout.RESPONSE_STATS,
        errors=layout.RESPONSE_ERRORS,
        records=layout.RESPONSE_RECORDS,
    log:
        "logs/generate/{dataset}.log",
    conda:
        "../envs/generate.yaml"
    # In-process generation takes the machine; HTTP generation waits on the servers, so
    # every dataset's job runs at once, sharing each endpoint's concurrency (a slot pool:
    # eagle3data.generation.engines.endpoint_slots).
    threads: 1 if is_streaming(config["generation"]["backend"]) else workflow.cores
    resources:
        # GPUs this job takes (0 on CPU and for the openai backend); see gpu_slots.
        gpu=job_gpus(config, "generation"),
    params:
        # Budgets are separate: changing one reuses the journal (docs/how-to/budgets.md,
        # "How a budget works").
        settings=GENERATION_SETTINGS,
        token_budget=lookup(dpath="datasets/{dataset}/token_budget", within=config),
        max_samples=lookup(dpath="datasets/{dataset}/max_samples", within=config),
    script:
        "../scripts/generate.py"
