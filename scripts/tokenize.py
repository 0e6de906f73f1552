"""Snakemake script: chat-template rendering, token ids and assistant-only loss masks."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent / "src"))

from eagle3data.jobs import run_step
from eagle3data.tokenization.settings import TokenizeSettings
from eagle3data.tokenization.stage import tokenize

run_step(
    snakemake.log[0],
    tokenize,
    dataset=snakemake.wildcards.dataset,
    responses_path=snakemake.input.responses,
    model_path=str(Path(snakemake.input.model).parent),
    settings=TokenizeSettings.parse(json.loads(snakemake.params.settings)),
    # Whether the model's own code may run decides whether it loads, not what it writes:
    # from the config, not params (a rerun trigger).
    trust_remote_code=snakemake.config["model"]["trust_remote_code"],
    out_tokenized=snakemake.output.tokenized,
    out_stats=snakemake.output.stats,
)
