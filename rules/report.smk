# The run report: pictures of lengths, budget use, truncation, throughput and shards,
# plus summary.html. `snakemake --report report.zip` packages them with the captions
# in report/ (see docs/reference/status.md, "Report").


rule report:
    input:
        responses=expand(rules.generate.output.responses, dataset=DATASETS),
        response_stats=expand(rules.generate.output.stats, dataset=DATASETS),
        records=expand(rules.generate.output.records, dataset=DATASETS),
        tokenize_stats=expand(rules.tokenize.output.stats, dataset=DATASETS),
        plans=expand(rules.plan_shards.output.plan, dataset=DATASETS),
        manifests=expand(rules.validate.output.manifest, dataset=DATASETS),
    output:
        completion_lengths=report(
            layout.REPORT_FIGURE.format(figure="completion_lengths"),
            caption="../report/completion_lengths.rst",
            category="Generation",
            labels={"figure": "completion length per turn"},
        ),
        budget_use=report(
            layout.REPORT_FIGURE.format(figure="budget_use"),
            caption="../report/budget_use.rst",
            category="Generation",
            labels={"figure": "budget use"},
        ),
        truncation=report(
            layout.REPORT_FIGURE.format(figure="truncation"),
            caption="../report/truncation.rst",
            category="Generation",
            labels={"figure": "truncation rate"},
        ),
        throughput=report(
            layout.REPORT_FIGURE.format(figure="throughput"),
            caption="../report/throughput.rst",
            category="Generation",
            labels={"figure": "throughput over time"},
        ),
        shard_tokens=report(
            layout.REPORT_FIGURE.format(figure="shard_tokens"),
            caption="../report/shard_tokens.rst",
            category="Hidden states",
            labels={"figure": "tokens per shard"},
        ),
        summary=report(
            layout.REPORT_SUMMARY,
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
        shard_bytes=lookup(dpath="hidden_states/shard_bytes", within=config),
    script:
        "../scripts/report.py"
