"""Image prompts through real vLLM 0.32 (CPU build) on the tiny random Qwen2.5-VL
(``support.vlm_models``), one server for both stages: the README's pipeline with
``generation.backend: openai`` and ``hidden_states.backend: vllm`` against a vLLM capture
server started with ``--enable-scale-out`` (samples with images are captured through its
token route, ``/inference/v1/generate``, which takes token ids and images together). The
tokenize stage runs in ``.venv``, which has no torchvision: the target's processor is remote
code there, image-only. Qwen2.5-VL, not Qwen2-VL: vLLM's hidden-state extraction needs a
model that declares ``SupportsEagle3``, and its Qwen2-VL does not.

vLLM's Qwen-VL modules import transformers' torchvision image processor, and PyPI's
torchvision does not import beside the CPU torch. The server here is started with
``vision=True``: the torchvision setup.sh installs beside the venv, and the shim that lets
it import (``tests/support/vllm_vision/sitecustomize.py``). Without them vLLM stops at start
with its own error (the first test; docs/how-to/images.md, "What is verified").

The oracle is transformers itself, run here without our code: the target's processor
expands the same conversation (each image to its tokens), and its float32 forward with the
pixels gives the states the shards must hold.
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
    VLLMServer,
    VLLMServerError,
    greedy_generation,
    image_capture_server,
    vision_problem,
)
from support.vlm_models import QWEN2_VL_IMAGE_TOKEN, make_qwen2_vl_dir, qwen2_vl_processor
from support.workflow import Workflow, new_workflow, read_shard_states, write_prompts

from eagle3data.hidden_states.layers import resolve_aux_layers
from eagle3data.hidden_states.vllm_capture import TOKENS_ROUTE_FLAG, vllm_layer_ids

DATASET = "A1"
MANIFEST = f"results/hidden_states/{DATASET}/manifest.json"
RESULTS = f"results/hidden_states/{DATASET}"
MODEL = "qwen2.5-vl-tiny"
AUX_LAYERS = [0, 1, 2]  # of the model's 4: the last layer's output is the final state
# The images and their image tokens (make_qwen2_vl_dir: 14-pixel patches, 2x2 merged into one
# token): 56x56 is 2x2 cells of 28 pixels, 4 tokens; 100x60 is resized to 112x56, 4x2 cells, 8.
RED = png((200, 10, 10))
GREEN = png((10, 200, 10), (100, 60))
BLUE = png((10, 10, 200))
YELLOW = png((200, 200, 10), (100, 60))
TOKENS_PER_IMAGE = {RED: 4, GREEN: 8, BLUE: 4, YELLOW: 8}
# Each answered prompt: its text (the key of its row), its parts in order (bytes: an image).
PROMPTS: dict[str, list[bytes | str]] = {
    "What colour is this?": [RED, "What colour is this?"],
    "And this one?": ["And this one?", GREEN],  # sent as a path (data/green.png)
    "Compare the two.": [BLUE, "Compare the two.", YELLOW],
}
PLAIN = "Plain text, no image."
# float32 (vLLM's portable CPU kernels; in bf16 a capture server died of SIGILL on Intel VMs,
# tests/vllm/test_vllm_capture.py) and a 2048-token context.
SERVER_FLAGS = ["--dtype", "float32", "--max-model-len", "2048", TOKENS_ROUTE_FLAG]


def record(parts: list[bytes | str]) -> dict[str, Any]:
    def part(p: bytes | str) -> dict[str, Any]:
        if p is GREEN:
            return {"type": "image_url", "image_url": {"url": "green.png"}}
        return image_url(p) if isinstance(p, bytes) else text(p)

    return user(*(part(p) for p in parts))


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target (its processor as remote code, as the capture in .venv loads it) and the
    prompts: one image, one by path, two images, a broken image, plain text."""
    base = tmp_path_factory.mktemp("vllm-images")
    make_qwen2_vl_dir(base / MODEL, remote_processor=True, qwen2_5=True)
    data = base / "data"
    data.mkdir()
    (data / "green.png").write_bytes(GREEN)
    (data / "broken.png").write_bytes(png((1, 2, 3))[:40])  # a truncated file
    records = [record(parts) for parts in PROMPTS.values()]
    records.insert(
        1, user(text("Describe it."), {"type": "image_url", "image_url": {"url": "broken.png"}})
    )
    records.append({"messages": [{"role": "user", "content": PLAIN}]})
    write_prompts(data / f"{DATASET}.jsonl", records)
    return base


def test_vllm_cannot_serve_an_image_target_without_torchvision(base: Path) -> None:
    """The server without ``vision``: vLLM's own start-up error."""
    log = base / "no-vision-server.log"
    server = VLLMServer(base / MODEL, reasoning_parser=None, tool_call_parser=None, log_path=log)
    with pytest.raises(VLLMServerError, match="exited with code"), server:
        pass
    text = log.read_text(errors="replace")
    assert "No module named 'torchvision'" in text
    assert "Qwen2_5_VLForConditionalGeneration" in text


@pytest.fixture(scope="module")
def image_run(base: Path) -> Iterator[Workflow]:
    """The pipeline up to the manifest, generated and captured by one vLLM server (served
    with ``vision``); then the capture forced again. The workflow's ``recaptured`` attribute
    holds the shards' bytes of both captures; ``storage_left`` what the server's storage
    folder held at the end."""
    if problem := vision_problem():
        pytest.skip(problem)
    model = base / MODEL
    capture = HiddenStateCapture(
        vllm_layer_ids(resolve_aux_layers(AUX_LAYERS, 4, "layer_output")), base / "storage"
    )
    with image_capture_server(model, capture, SERVER_FLAGS, base / "server.log") as server:
        wf = new_workflow(
            base,
            model,
            {DATASET: {"path": str(base / "data" / f"{DATASET}.jsonl"), "format": "messages"}},
            model={"trust_remote_code": True},
            generation=greedy_generation(server),
            hidden_states={
                "backend": "vllm",
                "dtype": "float32",
                "vllm": {"url": server.url},
                "aux_layers": AUX_LAYERS,
            },
        )
        wf.run(MANIFEST)
        first = read_shard_states(wf.path(RESULTS)).shards
        wf.run(MANIFEST, "--forcerun", "hidden_states")
        again = read_shard_states(wf.path(RESULTS)).shards
        wf.recaptured = (first, again)  # type: ignore[attr-defined]
        wf.storage_left = sorted(p.name for p in capture.folder.glob("*"))  # type: ignore[attr-defined]
    yield wf


@pytest.fixture(scope="module")
def rows(image_run: Workflow) -> dict[str, dict[str, Any]]:
    """The response rows by their first user turn's text."""

    def key(content: str | list[dict[str, Any]]) -> str:
        if isinstance(content, str):
            return content
        return " ".join(p["text"] for p in content if p["type"] == "text")

    return {key(r["messages"][0]["content"]): r for r in image_run.responses(DATASET)}


@pytest.fixture(scope="module")
def processor(base: Path) -> Any:
    return qwen2_vl_processor(base / MODEL)


def expected_prompt(processor: Any, parts: list[bytes | str]) -> dict[str, torch.Tensor]:
    """The target's processor on the conversation: the template's render with one
    placeholder per image, each expanded to the image's tokens, and the pixels."""
    content = [
        {"type": "image"} if isinstance(p, bytes) else {"type": "text", "text": p} for p in parts
    ]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    images = [Image.open(io.BytesIO(p)).convert("RGB") for p in parts if isinstance(p, bytes)]
    return processor(text=[prompt], images=images, return_tensors="pt")


def image_runs(ids: list[int], image_token: int) -> list[int]:
    """The lengths of the runs of ``image_token`` in ``ids``, in order."""
    runs: list[int] = []
    for k, t in enumerate(ids):
        if t == image_token:
            if k and ids[k - 1] == image_token:
                runs[-1] += 1
            else:
                runs.append(1)
    return runs


def test_a_broken_image_is_one_recorded_skip(image_run: Workflow, rows: dict[str, Any]) -> None:
    skipped = image_run.path(f"results/prompts/{DATASET}.skipped.jsonl").read_text().splitlines()
    assert len(skipped) == 1 and "broken.png" in json.loads(skipped[0])["reason"]
    assert json.loads(skipped[0])["line"] == 2
    assert sorted(rows) == sorted([*PROMPTS, PLAIN])  # every other prompt answered


def test_vllms_prompt_ids_are_the_processors_expansion(
    rows: dict[str, dict[str, Any]], processor: Any
) -> None:
    """The prompt ids vLLM returned (``return_token_ids``) are the target's processor's:
    each image expanded to as many image tokens as its size gives."""
    image_token = processor.tokenizer.convert_tokens_to_ids(QWEN2_VL_IMAGE_TOKEN)
    for question, parts in PROMPTS.items():
        (turn,) = rows[question]["turns"]
        ids = turn["token_ids"]
        assert ids["prompt_shared"] == 0 and ids["completion"], question
        expected = expected_prompt(processor, parts)["input_ids"][0].tolist()
        assert ids["prompt"] == expected, question
        sizes = [TOKENS_PER_IMAGE[p] for p in parts if isinstance(p, bytes)]
        assert image_runs(ids["prompt"], image_token) == sizes, question
        assert turn["prompt_tokens"] == len(expected)  # vLLM's usage counts them too
    (plain,) = rows[PLAIN]["turns"]
    rendered = processor.apply_chat_template(
        [{"role": "user", "content": PLAIN}], tokenize=False, add_generation_prompt=True
    )
    assert plain["token_ids"]["prompt"] == processor.tokenizer(rendered)["input_ids"]


def test_samples_hold_the_engine_ids_and_never_supervise_an_image(
    image_run: Workflow, rows: dict[str, dict[str, Any]], processor: Any
) -> None:
    image_token = processor.tokenizer.convert_tokens_to_ids(QWEN2_VL_IMAGE_TOKEN)
    frame = pl.read_parquet(image_run.path(f"results/tokenized/{DATASET}.parquet"))
    samples = {r["id"]: r for r in frame.iter_rows(named=True)}
    assert len(samples) == len(rows)
    for question, row in rows.items():
        (turn,) = row["turns"]
        sample = samples[row["id"]]
        prompt, completion = turn["token_ids"]["prompt"], turn["token_ids"]["completion"]
        assert sample["input_ids"] == prompt + completion, question
        assert sample["loss_mask"] == [0] * len(prompt) + [1] * len(completion), question
        n_images = sum(isinstance(p, bytes) for p in PROMPTS.get(question, []))
        assert len(sample["images"] or []) == n_images, question
        assert all(
            m == 0
            for t, m in zip(sample["input_ids"], sample["loss_mask"], strict=True)
            if t == image_token
        )
    # Our template's render agrees with vLLM's prompts, each image's run of tokens read as
    # its one placeholder: where a turn differs, it is in the completion (the random model
    # writes byte tokens that re-tokenize otherwise), never in the prompt.
    stats = json.loads(image_run.path(f"results/tokenized/{DATASET}.stats.json").read_text())
    assert stats["token_ids"]["turns_from_engine_ids"] == len(rows)
    assert all(d["part"] == "completion" for d in stats["token_ids"]["differences"])
    manifest = json.loads(image_run.path(MANIFEST).read_text())
    assert manifest["num_image_tokens"] == sum(TOKENS_PER_IMAGE.values())


def test_states_after_the_images_equal_transformers(
    image_run: Workflow, rows: dict[str, dict[str, Any]], processor: Any
) -> None:
    """The states vLLM captured on its own ids equal transformers' float32 forward of the
    same ids with the same pixels (the target's image processor), aux layers and the
    pre-norm final state, every position after an image included."""
    from transformers import AutoModelForImageTextToText

    image_token = processor.tokenizer.convert_tokens_to_ids(QWEN2_VL_IMAGE_TOKEN)
    model_dir = Path(image_run.config["model"]["path"])
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    seen: list[torch.Tensor] = []  # the final norm's input: the pre-norm state stored
    model.model.language_model.norm.register_forward_hook(lambda m, i, o: seen.append(i[0]))
    read = read_shard_states(image_run.path(RESULTS))
    assert read.layers == AUX_LAYERS
    for question in ("What colour is this?", "Compare the two."):
        aux, last, ids = read.states[rows[question]["id"]]
        (turn,) = rows[question]["turns"]
        assert ids == turn["token_ids"]["prompt"] + turn["token_ids"]["completion"]
        inputs = expected_prompt(processor, PROMPTS[question])
        full = {
            **inputs,
            "input_ids": torch.tensor([ids]),
            "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
            "mm_token_type_ids": (torch.tensor([ids]) == image_token).long(),
        }
        seen.clear()
        with torch.no_grad():
            out = model.model(**full, output_hidden_states=True)
        expected_last = seen[0][0]
        expected_aux = torch.cat([out.hidden_states[k + 1][0] for k in AUX_LAYERS], -1)
        after = max(k for k, t in enumerate(ids) if t == image_token) + 1
        assert after < len(ids)
        for got, want in ((last, expected_last), (aux, expected_aux)):
            torch.testing.assert_close(got[after:], want[after:], rtol=1e-3, atol=1e-4)
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)


def test_the_capture_is_repeatable_and_leaves_no_file(image_run: Workflow) -> None:
    """The capture forced again writes the same bytes, and every file the server wrote (the
    capture's, and the generation requests') was read and deleted."""
    first, again = image_run.recaptured  # type: ignore[attr-defined]
    assert first and first == again
    assert image_run.storage_left == []  # type: ignore[attr-defined]
    manifest = json.loads(image_run.path(MANIFEST).read_text())
    assert manifest["capture_fingerprint"]["engine"].startswith("vllm 0.32")
