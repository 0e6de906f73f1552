"""Snakemake script: chat-template rendering, token ids and assistant-only loss masks."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent / "src"))

from eagle3data.steps import run_step, tokenize

run_step(
    snakemake.log[0],
    tokenize,
    dataset=snakemake.wildcards.dataset,
    responses_path=snakemake.input.responses,
    model_path=snakemake.config["model"]["path"],
    chat_template_kwargs=snakemake.config["model"]["chat_template_kwargs"],
    max_seq_len=snakemake.config["hidden_states"]["max_seq_len"],
    out_tokenized=snakemake.output.tokenized,
    out_stats=snakemake.output.stats,
)
