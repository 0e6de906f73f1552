"""The whole workflow against a real engine: llama.cpp's OpenAI-compatible server
serving the SmolLM2 GGUF; its responses feed tokenize and the hidden states of the
same model converted to transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.llama_server import LlamaServer
from support.workflow import new_workflow, sharegpt_prompts, write_prompts

from eagle3data.demo_model import find_demo_gguf

pytestmark = pytest.mark.e2e


def test_generate_tokenize_and_extract_against_llama_cpp(tmp_path: Path, smollm2_dir: Path) -> None:
    prompts = write_prompts(tmp_path / "A1.jsonl", sharegpt_prompts(12))
    datasets = {"A1": {"path": str(prompts), "format": "sharegpt", "token_budget": 250}}
    with LlamaServer(find_demo_gguf(), n_ctx=2048) as server:
        wf = new_workflow(
            tmp_path,
            smollm2_dir,
            datasets,
            generation={
                "backend": "openai",
                "endpoints": [server.url],
                "served_model": server.model_name,
                "concurrency": 2,
                "sampling": {"temperature": 0.0, "max_tokens": 48},
                # llama.cpp applies repeat_penalty 1.1, top_k 40 and min_p 0.05 unless told.
                "extra_body": {"repeat_penalty": 1.0, "top_k": 0, "min_p": 0.0},
            },
            hidden_states={"dtype": "float32", "shard_bytes": 50_000_000},
        )
        wf.run()
        assert wf.plans_nothing()
    rows = wf.responses("A1")
    assert rows
    assert sum(r["usage"]["completion_tokens"] for r in rows) <= 250
    assert all(r["finish_reason"] in {"stop", "length"} for r in rows)
    assert all(t.get("usage_source") is None for r in rows for t in r["turns"])
    assert any(len(r["turns"]) > 1 for r in rows), "a multi-turn prompt went through the server"
    manifest = json.loads(wf.path("results/hidden_states/A1/manifest.json").read_text())
    assert manifest["num_samples"] == len(rows)
    assert manifest["attrs"]["aux_layer_ids"] == [1, 14, 26]
    # What captured them: the transformers backend on this CPU, the layers its hooks took.
    captured = manifest["capture_fingerprint"]
    assert captured["engine"].startswith("transformers ") and captured["layout"] == "cpu"
    assert captured["aux_layer_ids"] == [1, 14, 26] and captured["final_state"] == "pre_norm"
    assert captured["tokenizer_hash"] == manifest["attrs"]["tokenizer_hash"]
    assert wf.path("results/responses/A1.errors.jsonl").read_text() == ""
