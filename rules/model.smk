rule demo_model:
    output:
        config=f"{DEMO_MODEL_DIR}/config.json",
        weights=f"{DEMO_MODEL_DIR}/model.safetensors",
        tokenizer=f"{DEMO_MODEL_DIR}/tokenizer.json",
    log:
        "logs/demo_model.log",
    conda:
        "../envs/torch.yaml"
    threads: workflow.cores
    script:
        "../scripts/demo_model.py"
