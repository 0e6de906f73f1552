"""The operator's first command on the GPU box, ``tests/gpu/check_sglang.py``, on its CPU path
(``--device cpu``): SGLang's offline Engine with our ``forward_hooks`` hook against the
transformers backend, at tensor parallel 2, on the shrunken Kimi-K2.5 as K2.5 ships it
(SGLang's own ``KimiK25ForConditionalGeneration`` and ``DeepseekV2`` code with K2.5's real
MLA geometry, its sigmoid/noaux_tc router, shared and routed experts), with data-parallel
attention, the layout Kimi-K2.5 is served with on 8 GPUs (plain tensor parallel runs through
the workflow in test_parallel_capture.py).

The check compares rows per sample, per-token cosine and max difference, and that each aux
block is nearest to the layer it should be; it prints which ranks wrote the rows. The
other targets, layouts and hand-offs run through the workflow in test_parallel_capture.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

CHECK = Path(__file__).resolve().parents[1] / "gpu" / "check_sglang.py"

# Width 256 and a 600-token long sample keep each case under a minute on 2 cores; the MLA
# head dimensions stay K2.5's.
SMALL = ["--hidden", "256", "--long-tokens", "600"]

# The layout Kimi-K2.5 is served with; plain tp 2 (a writer and a replica) runs through the
# workflow on the Llama and the K2.5 wrapper in test_parallel_capture.py, so it is not
# checked here again.
CASES = {
    "tp2-dp-attention2": (
        ["--tp", "2", "--dp-attention", "2"],
        ["scheduler DP0 TP0", "scheduler DP1 TP1"],
        [],
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_the_gpu_check_passes_on_the_cpu_engine_at_tp2(case: str) -> None:
    layout, writers, replicas = CASES[case]
    proc = subprocess.run(
        [sys.executable, str(CHECK), "--device", "cpu", "--model", "kimi-wrapper", *SMALL, *layout],
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout
    print(out)
    assert proc.returncode == 0 and "PASS" in out, f"{out}\n{proc.stderr[-6000:]}"
    handoff = re.search(r"^hand-off: (.*)$", out, flags=re.MULTILINE)
    assert handoff is not None, out
    wrote = re.findall(r"(scheduler[\w ]*) \(pid \d+\) wrote", handoff.group(1))
    held = re.findall(r"(scheduler[\w ]*) \(pid \d+\) holds replicas", handoff.group(1))
    assert (sorted(wrote), sorted(held)) == (writers, replicas), handoff.group(1)
    layers = re.search(r"aux layer outputs \[([\d, ]+)\] \(sglang ids \[([\d, ]+)\]\)", out)
    assert layers is not None
    assert layers.group(1) == layers.group(2) == "1, 3, 4"  # Kimi: "first id 1" rule
