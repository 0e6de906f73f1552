# The run report: pictures of lengths, budget use, truncation, throughput and shards,
# plus summary.html. `snakemake --report report.zip` packages them with the captions
# in report/ (see README, "Report").


rule report:
    input:
        responses=expand("results/responses/{dataset}.jsonl", dataset=DATASETS),
        response_stats=expand("results/responses/{dataset}.stats.json", dataset=DATASETS),
        tokenize_stats=expand("results/tokenized/{dataset}.stats.json", dataset=DATASETS),
        plans=expand("results/hidden_states/{dataset}/plan.json", dataset=DATASETS),
        manifests=expand("results/hidden_states/{dataset}/manifest.json", dataset=DATASETS),
    output:
        completion_lengths=report(
            "results/report/completion_lengths.png",
            caption="../report/completion_lengths.rst",
            category="Generation",
            labels={"figure": "completion length per turn"},
        ),
        budget_use=report(
            "results/report/budget_use.png",
            caption="../report/budget_use.rst",
            category="Generation",
            labels={"figure": "budget use"},
        ),
        truncation=report(
            "results/report/truncation.png",
            caption="../report/truncation.rst",
            category="Generation",
            labels={"figure": "truncation rate"},
        ),
        throughput=report(
            "results/report/throughput.png",
            caption="../report/throughput.rst",
            category="Generation",
            labels={"figure": "throughput over time"},
        ),
        shard_tokens=report(
            "results/report/shard_tokens.png",
            caption="../report/shard_tokens.rst",
            category="Hidden states",
            labels={"figure": "tokens per shard"},
        ),
        summary=report(
            "results/report/summary.html",
            caption="../report/summary.rst",
            category="Summary",
            labels={"figure": "tables and pictures, one page"},
        ),
    log:
        "logs/report/report.log",
    conda:
        "../envs/report.yaml"
    params:
        datasets=DATASETS,
        shard_bytes=config["hidden_states"]["shard_bytes"],
    script:
        "../scripts/report.py"
