rule demo_model:
    output:
        config=f"{layout.DEMO_MODEL}/config.json",
        weights=f"{layout.DEMO_MODEL}/model.safetensors",
        tokenizer=f"{layout.DEMO_MODEL}/tokenizer.json",
    log:
        "logs/demo_model.log",
    conda:
        "../envs/torch.yaml"
    threads: workflow.cores
    script:
        "../scripts/demo_model.py"
