"""SGLang's own capture code against the transformers backend, on CPU: tests/gpu/check_sglang.py
with ``--device cpu`` (SGLang's offline Engine with ``enable_return_aux_hidden_states``, our
``forward_hooks`` hook and both hand-offs), for the Llama model and the Kimi-shaped DeepSeek-V3
model, plain and as K2.5's multimodal wrapper (SGLang's own ``KimiK25ForConditionalGeneration``
and ``DeepseekV2`` code: MLA, the sigmoid/noaux_tc router, shared and routed experts).

The check compares rows per sample, per-token cosine and max difference, and that each aux
block is nearest to the layer it should be: the per-model layer-id translation
(``sglang_layer_ids``) is checked against SGLang's real ``set_eagle3_layers_to_capture``, in
both of its DeepSeek branches (a first id of 1, and any other first id).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

CHECK = Path(__file__).resolve().parents[1] / "gpu" / "check_sglang.py"

CASES = [
    ("llama", "shared_memory", None),
    ("llama", "lists", None),
    ("kimi", "shared_memory", None),
    ("kimi", "lists", None),
    ("kimi-wrapper", "shared_memory", None),
    ("kimi-wrapper", "lists", None),
    # DeepSeek's other branch: a first id other than 1 is sent as hidden_states indices.
    ("kimi", "shared_memory", "2,3,5"),
]


def run_check(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(CHECK), "--device", "cpu", *args],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    out = proc.stdout
    assert proc.returncode == 0 and "PASS" in out, f"{out}\n{proc.stderr[-6000:]}"
    return out


@pytest.mark.parametrize(
    ("model", "handoff", "aux"),
    CASES,
    ids=[f"{m}-{h}" + (f"-aux{a.replace(',', '.')}" if a else "") for m, h, a in CASES],
)
def test_sglang_capture_matches_transformers(model: str, handoff: str, aux: str | None) -> None:
    args = ["--model", model, "--handoff", handoff]
    if aux:
        args += ["--aux-layers", aux]
    out = run_check(*args)
    print(out)
    assert f"sglang ({handoff} hand-off) capture" in out
    layers = re.search(r"aux layer outputs \[([\d, ]+)\] \(sglang ids \[([\d, ]+)\]\)", out)
    assert layers is not None
    outputs, sent = ([int(x) for x in g.split(",")] for g in layers.groups())
    if aux:
        assert outputs == [int(x) for x in aux.split(",")]
    if model == "llama":
        assert sent == outputs  # Llama adds 1 to every id itself
    elif outputs[0] == 1:
        assert sent == outputs  # DeepSeek/Kimi: "first id 1" means layer outputs
    else:
        assert sent == [k + 1 for k in outputs]  # else hidden_states indices
