"""Kimi-K2.5 with images through real vLLM 0.32 (CPU build): the tiny K2.5 VLM
(``support.vlm_models.make_kimi_vlm_dir`` with K2.5's MLA head dimensions, a runnable MoonViT,
K2.5's remote-code tiktoken tokenizer and real chat template) served by one capture server
for both stages, through the README's pipeline in ``.venv``: ``generation.backend: openai``
and ``hidden_states.backend: vllm``, samples with images captured through vLLM's token route
(``--enable-scale-out``). vLLM's K2.5 code reads keys transformers' K2.5 classes do not
write (``add_kimi_vllm_keys``); the server runs with the torchvision shim (``vision=True``)
and vLLM's reference CPU MLA backend, as the text-only K2.5 shape in test_vllm_capture.py.

The oracle is transformers' own K2.5 forward in float32 of the ids the shards hold with the
image's pixels (``kimi_pixel_inputs``: the processor's output built without torchvision),
without our code.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from PIL import Image
from support.image_prompts import image_url, png, text, user
from support.vllm_server import (
    HiddenStateCapture,
    greedy_generation,
    image_capture_server,
    vision_problem,
)
from support.vlm_models import (
    KIMI_IMAGE_TOKEN_ID,
    add_kimi_vllm_keys,
    kimi_num_image_tokens,
    kimi_pixel_inputs,
    make_kimi_vlm_dir,
)
from support.workflow import Workflow, new_workflow, read_shard_states, write_prompts

from eagle3data.hidden_states.layers import resolve_aux_layers
from eagle3data.hidden_states.vllm_capture import TOKENS_ROUTE_FLAG, vllm_layer_ids

pytestmark = pytest.mark.e2e

DATASET = "A1"
RESULTS = f"results/hidden_states/{DATASET}"
MANIFEST = f"{RESULTS}/manifest.json"
RED = png((200, 10, 10))  # 56x56: 2x2 cells of 28 pixels, 4 tokens
GREEN = png((10, 200, 10), (100, 60))  # padded to 112x84: 4x3 cells, 12 tokens
QUESTIONS = {"What colour is this?": RED, "And this?": GREEN}
PLAIN = "Plain text, no image."
SERVER_FLAGS = [
    "--trust-remote-code",
    "--attention-backend",
    "CPU_MLA",
    "--max-model-len",
    "2048",
    "--dtype",
    "float32",
    TOKENS_ROUTE_FLAG,
]


@pytest.fixture(scope="module")
def kimi_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The pipeline up to the manifest against one vLLM server; what its storage folder
    held at the end."""
    if problem := vision_problem():
        pytest.skip(problem)
    base = tmp_path_factory.mktemp("vllm-kimi-images")
    cache = {"TIKTOKEN_CACHE_DIR": str(base / "tiktoken-cache")}
    model = add_kimi_vllm_keys(make_kimi_vlm_dir(base / "Kimi-K2.5-vl-tiny", k25_attention=True))
    records = [
        user(image_url(RED), text("What colour is this?")),
        user(text("And this?"), image_url(GREEN)),
        {"messages": [{"role": "user", "content": PLAIN}]},
    ]
    prompts = write_prompts(base / f"{DATASET}.jsonl", records)
    aux = resolve_aux_layers("auto", 8, "layer_output")
    capture = HiddenStateCapture(vllm_layer_ids(aux), base / "storage")
    with image_capture_server(model, capture, SERVER_FLAGS, base / "server.log", cache) as server:
        wf = new_workflow(
            base,
            model,
            {DATASET: {"path": str(prompts), "format": "messages"}},
            model={"trust_remote_code": True, "chat_template_kwargs": {"thinking": False}},
            generation=greedy_generation(server),
            hidden_states={"backend": "vllm", "dtype": "float32", "vllm": {"url": server.url}},
        )
        wf.env.update(cache)
        wf.run(MANIFEST)
        left = sorted(p.name for p in capture.folder.glob("*"))
    yield {"wf": wf, "left": left, "aux": list(aux.layer_ids)}


def first_text(row: dict[str, Any]) -> str:
    content = row["messages"][0]["content"]
    if isinstance(content, str):
        return content
    return " ".join(p["text"] for p in content if p["type"] == "text")


def test_kimi_images_expand_as_vllm_expands_them_never_supervised(
    kimi_run: dict[str, Any],
) -> None:
    wf: Workflow = kimi_run["wf"]
    rows = {first_text(r): r for r in wf.responses(DATASET)}
    assert sorted(rows) == sorted([*QUESTIONS, PLAIN])
    frame = pl.read_parquet(wf.path(f"results/tokenized/{DATASET}.parquet"))
    samples = {r["id"]: r for r in frame.iter_rows(named=True)}
    for question, image in QUESTIONS.items():
        sample = samples[rows[question]["id"]]
        ids, mask = sample["input_ids"], sample["loss_mask"]
        size = Image.open(io.BytesIO(image)).size
        assert ids.count(KIMI_IMAGE_TOKEN_ID) == kimi_num_image_tokens(size[1], size[0])
        assert all(m == 0 for t, m in zip(ids, mask, strict=True) if t == KIMI_IMAGE_TOKEN_ID)
    manifest = json.loads(wf.path(MANIFEST).read_text())
    assert manifest["num_image_tokens"] == 4 + 12
    assert manifest["capture_fingerprint"]["engine"].startswith("vllm 0.32")
    assert kimi_run["left"] == []  # every file the server wrote was read and deleted


def test_kimi_states_equal_transformers_with_the_image(kimi_run: dict[str, Any]) -> None:
    """vLLM's aux layers and pre-norm final state of each image sample against
    transformers' float32 K2.5 forward of the same ids with the image's pixels, every
    position after the image included. Per-token cosine and relative size, as the text-only
    K2.5 check: the fixture routes each token to 2 of 4 experts, and a near tie may pick
    another expert for a single token."""
    from transformers import AutoModelForImageTextToText

    wf: Workflow = kimi_run["wf"]
    model_dir = Path(wf.config["model"]["path"])
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    seen: list[torch.Tensor] = []  # the final norm's input: the pre-norm state stored
    model.model.language_model.norm.register_forward_hook(lambda m, i, o: seen.append(i[0]))
    read = read_shard_states(wf.path(RESULTS))
    assert read.layers == kimi_run["aux"] and read.final_state == "pre_norm"
    rows = {first_text(r): r for r in wf.responses(DATASET)}
    for question, image in QUESTIONS.items():
        aux, last, ids = read.states[rows[question]["id"]]
        pixels = kimi_pixel_inputs(Image.open(io.BytesIO(image)).convert("RGB"))
        seen.clear()
        with torch.no_grad():
            out = model.model(
                input_ids=torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                output_hidden_states=True,
                **pixels,
            )
        want_aux = torch.cat([out.hidden_states[k + 1][0] for k in read.layers], -1)
        after = max(k for k, t in enumerate(ids) if t == KIMI_IMAGE_TOKEN_ID) + 1
        assert after < len(ids)
        for got, want in ((aux, want_aux), (last, seen[0][0])):
            for part in (slice(None), slice(after, None)):
                cos = torch.nn.functional.cosine_similarity(got[part], want[part], dim=-1)
                size = ((got[part] - want[part]).norm(dim=-1) / want[part].norm(dim=-1)).median()
                assert cos.mean() > 0.9999 and cos.min() > 0.99, (question, cos.min())
                assert size < 1e-3, (question, size)
