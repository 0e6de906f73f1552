"""Image prompts end to end on a tiny random Qwen2-VL (support.vlm_models), through the
README's command with the in-process engine: prompts -> responses -> tokenized samples ->
shards -> manifest. The oracle is transformers itself, run here without our code: the
target's own processor expands the conversation the target saw, and its forward with the
pixels gives the states the shards must hold.
"""

from __future__ import annotations

import io
import json
import signal
from pathlib import Path

import polars as pl
import pytest
import torch
from PIL import Image
from support.image_prompts import image_url, png, text, user
from support.vlm_models import make_qwen2_vl_dir
from support.workflow import Workflow, new_workflow, write_prompts

from eagle3data.shards import open_shard

IMAGE_TOKEN = 386  # the tiny Qwen2-VL's <|image_pad|>
MANIFEST = "results/hidden_states/A1/manifest.json"


MORE = 6  # further image prompts: a run long enough to be killed in the middle


@pytest.fixture(scope="module")
def image_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target and the dataset: images inline, by path, broken; text with and without."""
    base = tmp_path_factory.mktemp("images")
    make_qwen2_vl_dir(base / "qwen2-vl-tiny", remote_processor=True)
    (base / "data").mkdir()
    (base / "data" / "green.png").write_bytes(png((10, 200, 10), (100, 60)))
    (base / "data" / "broken.png").write_bytes(png((1, 2, 3))[:40])  # a truncated file
    records = [
        user(image_url(png((200, 10, 10))), text("What colour is this?")),
        user(text("And this one?"), {"type": "image_url", "image_url": {"url": "green.png"}}),
        user(text("What colour is this?")),  # the first prompt's text without its image
        user(text("Describe it."), {"type": "image_url", "image_url": {"url": "broken.png"}}),
        {"messages": [{"role": "user", "content": "Plain text, no image."}]},
        *(user(image_url(png((40 * i, 100, 50))), text(f"Question {i}?")) for i in range(MORE)),
    ]
    write_prompts(base / "data" / "A1.jsonl", records)
    return base


def image_workflow(base: Path, name: str) -> Workflow:
    wf = new_workflow(
        base,
        base / "qwen2-vl-tiny",
        {"A1": {"path": str(base / "data" / "A1.jsonl"), "format": "messages"}},
        name,
        model={"trust_remote_code": True},
        # One conversation per batch: the journal grows one line at a time (resume test).
        generation={"batch_size": 1, "sampling": {"temperature": 0.0, "max_tokens": 6}},
        # The target's own dtype (bf16), as it generated: the agreement check then holds
        # (0.997 over 288 positions of a longer run, against 0.03 for the shifted control).
        hidden_states={"aux_layers": [0, 1, 2]},
        validate={"agreement": {"enabled": True, "positions_per_shard": "all"}},
    )
    return wf


@pytest.fixture(scope="module")
def image_run(image_base: Path) -> Workflow:
    wf = image_workflow(image_base, "wf")
    wf.run(MANIFEST)
    return wf


def test_a_broken_image_is_one_recorded_skip(image_run: Workflow) -> None:
    skipped = image_run.path("results/prompts/A1.skipped.jsonl").read_text().splitlines()
    assert len(skipped) == 1 and "broken.png" in json.loads(skipped[0])["reason"]
    assert json.loads(skipped[0])["line"] == 4
    assert len(image_run.responses("A1")) == 4 + MORE  # every other prompt answered


def test_image_tokens_are_the_processors_and_never_supervised(image_run: Workflow) -> None:
    frame = pl.read_parquet(image_run.path("results/tokenized/A1.parquet"))
    rows = {r["id"]: r for r in frame.iter_rows(named=True)}
    with_images = [r for r in rows.values() if r["images"]]
    assert len(with_images) == 2 + MORE
    for row in with_images:
        ids, mask = row["input_ids"], row["loss_mask"]
        image_positions = [k for k, t in enumerate(ids) if t == IMAGE_TOKEN]
        assert len(image_positions) in (4, 8)  # 56x56 and 100x60 with 2x2 merges
        assert all(mask[k] == 0 for k in image_positions)
        assert sum(mask) > 0
    assert all(
        not r["images"] and IMAGE_TOKEN not in r["input_ids"]
        for r in rows.values()
        if not r["images"]
    )


def test_the_validator_refuses_an_image_token_in_the_loss_mask(
    image_run: Workflow, tmp_path: Path
) -> None:
    """The validate job's own check, shown failing: a shard whose mask covers one image
    token of one sample is named with that sample; the shards as made pass."""
    import shutil

    import h5py
    import numpy as np

    from eagle3data.hidden_states.validation import image_tokens

    made = sorted(str(p) for p in image_run.path("results/hidden_states/A1").glob("shard-*.h5"))
    assert image_tokens(made, IMAGE_TOKEN).errors == []
    broken = tmp_path / "shard.h5"
    shutil.copy(made[0], broken)
    with h5py.File(broken, "r+") as f:
        first = int(np.flatnonzero(f["input_ids"][:] == IMAGE_TOKEN)[0])
        f["loss_mask"][first] = 1
    with open_shard(broken) as shard:
        owner = shard.sample_ids[int(np.searchsorted(shard.sample_offsets, first, "right")) - 1]
    errors = image_tokens([str(broken)], IMAGE_TOKEN).errors
    assert len(errors) == 1 and f"sample {owner}: 1 image token(s)" in errors[0], errors


def test_states_after_an_image_see_it_and_equal_transformers(image_run: Workflow) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model_dir = Path(image_run.config["model"]["path"])
    processor = AutoProcessor.from_pretrained(model_dir, trust_remote_code=True)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    shards = sorted(image_run.path("results/hidden_states/A1").glob("*.h5"))
    stored: dict[str, tuple[list[int], torch.Tensor]] = {}
    for path in shards:
        with open_shard(path) as shard:
            for k in range(len(shard)):
                sample = shard.sample(k)
                states = torch.from_numpy(sample["last_hidden_states"])
                stored[sample["id"]] = ([int(t) for t in sample["input_ids"]], states)
    first_turns = {r["id"]: r["messages"][0]["content"] for r in image_run.responses("A1")}
    red = next(i for i, c in first_turns.items() if isinstance(c, list) and c[0]["type"] == "image")
    plain = next(i for i, c in first_turns.items() if c == "What colour is this?")
    ids, last = stored[red]
    # The oracle: the target's processor and forward on the image, without our code.
    picture = Image.open(io.BytesIO(png((200, 10, 10)))).convert("RGB")
    prompt = processor.apply_chat_template(
        [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": "What colour is this?"}],
            }
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    inputs = processor(text=[prompt], images=[picture], return_tensors="pt")
    n_prompt = inputs["input_ids"].shape[1]
    assert ids[:n_prompt] == inputs["input_ids"][0].tolist()
    full = {
        **inputs,
        "input_ids": torch.tensor([ids]),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
    }
    full["mm_token_type_ids"] = (full["input_ids"] == IMAGE_TOKEN).long()
    seen: list[torch.Tensor] = []  # the final norm's input: the pre-norm state stored
    model.model.language_model.norm.register_forward_hook(lambda m, i, o: seen.append(i[0]))
    with torch.no_grad():
        model.model(**full)
    expected = seen[0][0]
    torch.testing.assert_close(last, expected.to(last.dtype))  # bf16's tolerance
    # The same text without the image: equal before the image, different after it (the
    # question's last token, just before the user turn's end).
    plain_ids, plain_last = stored[plain]
    start = next(k for k, (a, b) in enumerate(zip(ids, plain_ids, strict=False)) if a != b)
    assert 0 < start < ids.index(IMAGE_TOKEN)  # the image's opening tag, then its tokens
    torch.testing.assert_close(last[:start], plain_last[:start])
    end_of_turn = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    after, plain_after = (
        [k for k, t in enumerate(x) if t == end_of_turn][1] - 1 for x in (ids, plain_ids)
    )
    assert after > start and ids[after] == plain_ids[plain_after]
    change = torch.linalg.norm((last[after] - plain_last[plain_after]).float())
    assert change > 0.1 * torch.linalg.norm(plain_last[plain_after].float())


def test_the_manifest_counts_image_tokens(image_run: Workflow) -> None:
    manifest = json.loads(image_run.path(MANIFEST).read_text())
    assert manifest["num_image_tokens"] == 4 + 8 + 4 * MORE
    # Scored where the target produced the next token only: never an image token.
    check = manifest["agreement"]
    assert check["positions"] == manifest["num_loss_tokens"]
    assert check["agreement"] >= 0.8 > check["control_agreement"]
    # Which image processor made the pixels the states saw (the checkpoint's own, remote
    # code here; PIL's and torchvision's resize differently).
    engine = manifest["capture_fingerprint"]["engine"]
    assert engine.startswith("transformers ") and "(image processor " in engine, engine


def test_a_killed_image_run_resumes_to_the_same_bytes(
    image_base: Path, image_run: Workflow
) -> None:
    wf = image_workflow(image_base, "resumed")
    partial = wf.kill_and_resume("results/responses/A1.jsonl", signal.SIGKILL, after_records=3)
    wf.assert_resumed("A1", partial, image_run)
    wf.run(MANIFEST)
    for made in ("results/prompts/A1.images.parquet", "results/tokenized/A1.parquet"):
        assert wf.path(made).read_bytes() == image_run.path(made).read_bytes(), made
    shards = sorted(p.name for p in image_run.path("results/hidden_states/A1").glob("*.h5"))
    assert shards and shards == sorted(
        p.name for p in wf.path("results/hidden_states/A1").glob("*.h5")
    )
    for name in shards:
        shard = f"results/hidden_states/A1/{name}"
        assert wf.path(shard).read_bytes() == image_run.path(shard).read_bytes(), name


def test_speculators_reads_the_export_and_specforge_is_refused(image_run: Workflow) -> None:
    refused = image_run.run("results/specforge/A1", check=False)
    assert refused.returncode != 0
    assert "SpecForge does not train drafts of image-text targets" in refused.stderr
    # The export checks itself with speculators' own code before it is kept.
    image_run.run("results/speculators")
    exported = image_run.path("results/speculators")
    assert any(exported.iterdir())


def test_the_draft_check_trains_a_draft_for_an_image_text_target(image_run: Workflow) -> None:
    """speculators has no draft layers of Qwen-VL's kind: the draft is built as its own
    trainer builds one by default (llama layers shaped from the text decoder). A random
    tiny target teaches nothing, so only that it trains and measures is checked here."""
    image_run.run("results/draft_check/summary.json")
    summary = json.loads(image_run.path("results/draft_check/summary.json").read_text())
    assert summary["conversations"]["heldout"] > 0 and summary["conversations"]["train"] > 0
    assert set(summary["aggregate"]) >= {"trained", "untrained", "shifted", "aux_shuffled"}


def test_text_prompts_run_on_an_image_text_target_in_process(image_base: Path) -> None:
    """transformers builds Qwen2-VL's text decoder only inside the image-text model: the
    in-process engine runs such a target whole for text prompts too."""
    from eagle3data.generation.engines.transformers_engine import TransformersEngine

    sampling = {"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "top_k": -1}
    sampling |= {"repetition_penalty": 1.0, "stop": []}
    engine = TransformersEngine(
        str(image_base / "qwen2-vl-tiny"), sampling=sampling, trust_remote_code=True
    )
    (done,) = engine.complete([[{"role": "user", "content": "Hi there"}]], seed=0)
    assert done.completion_tokens > 0 and IMAGE_TOKEN not in (done.prompt_ids or [])
