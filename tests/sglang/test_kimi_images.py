"""Image prompts on the Kimi-K2.5 shape (support.vlm_models.make_kimi_vlm_dir: K2.5's
remote-code tiktoken tokenizer and real chat template with its media tokens, a DeepSeek-V3
decoder and a runnable MoonViT) through the README's command, in process: K2.5's image
processor needs torchvision, which this environment has and the main one cannot
(docs/reference/inputs.md, "Images"). The oracle is transformers' own K2.5 run on the
conversation the target saw, without our code."""

from __future__ import annotations

import io
import json
from pathlib import Path

import polars as pl
import pytest
import torch
from PIL import Image
from support.image_prompts import image_url, png, text, user
from support.sglang_server import SGLangServer, SGLangServerError
from support.vlm_models import make_kimi_vlm_dir, make_qwen2_vl_dir
from support.workflow import Workflow, new_workflow, write_prompts

from eagle3data.shards import open_shard

MEDIA_PAD = 163605  # <|media_pad|>: the token each image patch group becomes
MANIFEST = "results/hidden_states/A1/manifest.json"


@pytest.fixture(scope="module")
def kimi_image_run(tmp_path_factory: pytest.TempPathFactory) -> Workflow:
    base = tmp_path_factory.mktemp("kimi-images")
    cache = base / "tiktoken-cache"
    model = make_kimi_vlm_dir(base / "Kimi-K2.5-vl-tiny")
    records = [
        user(image_url(png((200, 10, 10))), text("What colour is this?")),
        user(text("What colour is this?")),
        user(text("And this?"), image_url(png((10, 200, 10), (100, 60)))),
    ]
    prompts = write_prompts(base / "A1.jsonl", records)
    wf = new_workflow(
        base,
        model,
        {"A1": {"path": str(prompts), "format": "messages"}},
        model={"trust_remote_code": True, "chat_template_kwargs": {"thinking": False}},
        generation={"sampling": {"temperature": 0.0, "max_tokens": 6}},
        hidden_states={"dtype": "float32", "final_state": "post_norm"},
    )
    wf.env["TIKTOKEN_CACHE_DIR"] = str(cache)
    wf.run(MANIFEST)
    return wf


def stored_samples(wf: Workflow) -> dict[str, tuple[list[int], list[int], torch.Tensor]]:
    out = {}
    for path in sorted(wf.path("results/hidden_states/A1").glob("*.h5")):
        with open_shard(path) as shard:
            for k in range(len(shard)):
                s = shard.sample(k)
                ids = [int(t) for t in s["input_ids"]]
                out[s["id"]] = (
                    ids,
                    [int(m) for m in s["loss_mask"]],
                    torch.from_numpy(s["last_hidden_states"]),
                )
    return out


def test_kimi_images_expand_to_media_pads_never_supervised(kimi_image_run: Workflow) -> None:
    frame = pl.read_parquet(kimi_image_run.path("results/tokenized/A1.parquet"))
    runs = sorted(row["input_ids"].count(MEDIA_PAD) for row in frame.iter_rows(named=True))
    assert runs == [0, 4, 12]  # 56x56 and 100x60 through K2.5's 14-pixel patches, 2x2 merge
    for ids, mask, _ in stored_samples(kimi_image_run).values():
        assert all(m == 0 for t, m in zip(ids, mask, strict=True) if t == MEDIA_PAD)
    manifest = json.loads(kimi_image_run.path(MANIFEST).read_text())
    assert manifest["num_image_tokens"] == 16


def test_kimi_states_equal_transformers_with_the_image(kimi_image_run: Workflow) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model_dir = Path(kimi_image_run.config["model"]["path"])
    processor = AutoProcessor.from_pretrained(model_dir, trust_remote_code=True)
    model = AutoModelForImageTextToText.from_pretrained(
        model_dir, dtype=torch.float32, trust_remote_code=True
    ).eval()
    samples = stored_samples(kimi_image_run)
    first = {r["id"]: r["messages"][0]["content"] for r in kimi_image_run.responses("A1")}
    red = next(i for i, c in first.items() if isinstance(c, list) and c[0]["type"] == "image")
    plain = next(i for i, c in first.items() if c == "What colour is this?")
    ids, _, last = samples[red]
    picture = Image.open(io.BytesIO(png((200, 10, 10)))).convert("RGB")
    pixels = processor.image_processor(images=[picture], return_tensors="pt")
    with torch.no_grad():
        out = model.model(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            **{k: v.to(torch.float32) if v.is_floating_point() else v for k, v in pixels.items()},
        )
    torch.testing.assert_close(last, out.last_hidden_state[0], rtol=1e-4, atol=1e-4)
    # Without the image: equal up to it, different after it.
    plain_ids, _, plain_last = samples[plain]
    start = next(k for k, (a, b) in enumerate(zip(ids, plain_ids, strict=False)) if a != b)
    assert 0 < start < ids.index(MEDIA_PAD)
    torch.testing.assert_close(last[:start], plain_last[:start], rtol=1e-4, atol=1e-4)
    assert (last[-1] - plain_last[-1]).abs().max() > 1e-3


def test_sglang_cannot_serve_an_image_target_on_this_cpu_build(tmp_path: Path) -> None:
    """SGLang 0.5.23's Qwen-VL image processor module needs a CPU kernel op
    (``fused_sigmoid_mul_cpu``) that the CPU build here lacks, so it registers no processor
    for the architecture and the server stops at start (docs/how-to/images.md). When this
    test fails, SGLang serves images here: verify the expanded prompt ids and update it."""
    model = make_qwen2_vl_dir(tmp_path / "qwen2-vl-tiny")
    log = tmp_path / "server.log"
    server = SGLangServer(model, reasoning_parser=None, tool_call_parser=None, log_path=log)
    with pytest.raises(SGLangServerError, match="exited with code"), server:
        pass
    assert "No processor registered for architecture: ['Qwen2VLForConditionalGeneration']" in (
        log.read_text(errors="replace")
    )
