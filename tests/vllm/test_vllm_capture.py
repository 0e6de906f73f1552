"""The ``hidden_states`` rule with ``backend: vllm`` against real vLLM 0.32 on CPU: a vLLM
OpenAI server started with vLLM's ``extract_hidden_states`` method and the stock
connector's CPU subclass (``tests/support/vllm_cpu_connector/``), in float32.

* The tiny Llama, one server for both stages: the generate rule talks to it (``backend:
  openai``) and the hidden_states jobs capture through it; states against a float32
  transformers forward (cosine >= 0.9999 per token, aux layers and the pre-norm final
  state), the manifest's agreement as with the transformers backend, and no file left in
  the server's storage folder (the generate job deletes those of its own requests).
* The shard jobs go through the run's capture engine (one client of the server per run).
* ``kill -9`` of the run in the middle of a shard, then the same command: byte-identical
  shards, the killed attempt's files gone, and no capture engine left.
* ``final_state: post_norm``: the target's own final norm of the pre-norm state, the aux
  states unchanged.
* Tensor parallel 2 (two CPU workers): the same states, one file per request (only rank 0
  writes).
* Qwen3 (another architecture of vLLM's): the same checks against transformers.
* A server that computes in another dtype than the config's: the job fails before any
  work, in one line.

* The Kimi-shaped DeepSeek-V3 target with K2.5's MLA head dimensions: the same checks.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from support.target_models import (
    forward_with_pre_norm,
    kimi_text_decoder,
    make_kimi_dir,
    make_llama_dir,
    make_qwen3_dir,
)
from support.vllm_server import HEAD_DIM, HiddenStateCapture, VLLMServer
from support.workflow import (
    Workflow,
    kill_group,
    new_workflow,
    read_shard_states,
    sharegpt_prompts,
    write_prompts,
)

from eagle3data.errors import VLLMCaptureError
from eagle3data.hidden_states.layers import resolve_aux_layers
from eagle3data.hidden_states.vllm_capture import VLLMCapture, vllm_layer_ids
from eagle3data.model_config import num_hidden_layers, read_model_config

DATASET = "A1"
RESULTS = f"results/hidden_states/{DATASET}"
MANIFEST = f"{RESULTS}/manifest.json"
SHARD_LOG = f"logs/hidden_states/{DATASET}"
# The tiny targets' 8 layers: the EAGLE-3 default aux layers (outputs 1, 3, 4).
AUX = resolve_aux_layers("auto", 8, "layer_output")
# In bf16 a capture server's worker died of SIGILL at its first request on this workplace's
# Intel VMs (AMX advertised, not granted: vLLM's CPU attention takes AMX kernels for bf16
# there); float32 takes the portable kernels, and is what the states are compared with.
DTYPE = "float32"
PROMPTS = 16
# Cosine of every token's state to the float32 transformers forward.
MIN_COSINE = 0.9999


def capture_server(
    base: Path,
    model: Path,
    name: str,
    *,
    tp: int = 1,
    extra: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> VLLMServer:
    """A capture server for ``model`` (the AUX layers and the pre-norm final state),
    writing into ``base/{name}-storage``; at ``tp`` > 1 one worker per CPU."""
    extra = ["--dtype", DTYPE, *extra]
    env = dict(env or {})
    if tp > 1:
        extra += ["--tensor-parallel-size", str(tp)]
        cpus = sorted(os.sched_getaffinity(0))
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cpus[i % len(cpus)]) for i in range(tp))
    return VLLMServer(
        model,
        capture=HiddenStateCapture(vllm_layer_ids(AUX), base / f"{name}-storage"),
        reasoning_parser=None,
        tool_call_parser=None,
        max_num_seqs=8,
        extra_args=extra,
        extra_env=env,
        log_path=base / f"{name}-server.log",
    )


def leftovers(server: VLLMServer) -> list[str]:
    storage = server.capture.folder if server.capture else None
    return sorted(p.name for p in storage.iterdir()) if storage and storage.exists() else []


@dataclass
class Round:
    name: str
    shards: dict[str, bytes]
    states: dict[str, tuple[torch.Tensor, torch.Tensor, list[int]]]
    final_state: str
    logs: str
    leftovers: list[str]


def collect(wf: Workflow, name: str, server: VLLMServer) -> Round:
    read = read_shard_states(wf.path(RESULTS))
    assert read.layers == list(AUX.layer_ids)
    logs = "".join(p.read_text() for p in sorted(wf.path(SHARD_LOG).glob("*.log")))
    return Round(name, read.shards, read.states, read.final_state, logs, leftovers(server))


def capture_settings(server: VLLMServer, **more: Any) -> dict[str, Any]:
    return {
        "backend": "vllm",
        "dtype": DTYPE,
        "vllm": {"url": server.url},
        # One shard of batches of a conversation or two: a kill lands in the middle of it.
        "shard_bytes": 64 * 2**20,
        "batch_tokens": 64,
        **more,
    }


def recapture(wf: Workflow, server: VLLMServer, name: str, **settings: Any) -> Round:
    """The manifest again with only the capture's settings changed (its jobs forced)."""
    wf.config["hidden_states"].update(capture_settings(server, **settings))
    wf.write_config()
    for log in wf.path(SHARD_LOG).glob("*.log"):
        log.unlink()
    wf.run(MANIFEST, "--forcerun", "hidden_states", timeout=900)
    return collect(wf, name, server)


# --- checks -------------------------------------------------------------------------------


def reference(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def check_against_the_target(model: torch.nn.Module, rnd: Round) -> None:
    assert rnd.states, f"{rnd.name}: no samples"
    for sample_id, (aux, last, ids) in rnd.states.items():
        assert aux.shape[0] == last.shape[0] == len(ids), f"{rnd.name} {sample_id}: rows"
        out, pre = forward_with_pre_norm(model, ids)
        want_aux = torch.cat([out.hidden_states[k + 1][0] for k in AUX.layer_ids], -1)
        want_last = {"pre_norm": pre, "post_norm": out.hidden_states[-1][0]}[rnd.final_state]
        for part, got, want in (("aux", aux, want_aux), ("final", last, want_last)):
            cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
            size = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
            assert cos.min().item() >= MIN_COSINE and size < 0.01, (
                f"{rnd.name} {sample_id} {part}: cosine min {cos.min():.6f}, relative "
                f"difference max {size:.5f}"
            )


def capture_engines(wf: Workflow) -> list[int]:
    """The capture engines working in ``wf``'s directory."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
            cwd = (proc / "cwd").resolve()
        except OSError:
            continue  # not a process, or gone
        if b"eagle3data.hidden_states.capture_service" in cmdline and cwd == wf.root.resolve():
            found.append(int(proc.name))
    return found


def engines_after(wf: Workflow, timeout: float = 30) -> list[int]:
    """The capture engines still there ``timeout`` s after the run ended, or none."""
    deadline = time.monotonic() + timeout
    while capture_engines(wf) and time.monotonic() < deadline:
        time.sleep(0.2)
    return capture_engines(wf)


def run_until_a_batch_then_kill(wf: Workflow, args: list[str]) -> str:
    """Start ``args``, SIGKILL the whole run once its shard job has captured a batch and
    before it ends; the job log at the kill."""
    for old in wf.path(SHARD_LOG).glob("*.log"):
        old.unlink()
    proc = wf.start(*args)
    deadline = time.monotonic() + 600
    while True:
        text = "".join(p.read_text() for p in wf.path(SHARD_LOG).glob("*.log"))
        if re.search(r"batch \d+/\d+", text):
            break
        assert proc.poll() is None, f"the run ended before its first batch:\n{text[-3000:]}"
        assert time.monotonic() < deadline, text[-3000:]
        time.sleep(0.01)
    assert kill_group(proc, signal.SIGKILL) != 0
    return "".join(p.read_text() for p in wf.path(SHARD_LOG).glob("*.log"))


# --- the tiny Llama: one server for both stages ------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    base = tmp_path_factory.mktemp("vllm-capture-llama")
    model_dir = make_llama_dir(base / "tiny-llama", head_dim=HEAD_DIM)
    prompts = write_prompts(base / "prompts.jsonl", sharegpt_prompts(PROMPTS))
    rounds: dict[str, Any] = {"model": model_dir}
    with capture_server(base, model_dir, "tp1") as server:
        wf = new_workflow(
            base,
            model_dir,
            {DATASET: {"path": str(prompts), "format": "sharegpt"}},
            generation={
                "backend": "openai",
                "endpoints": [server.url],
                "served_model": server.model_name,
                "sampling": {"temperature": 0.0, "max_tokens": 48},
            },
            hidden_states=capture_settings(server),
            validate={"agreement": {"enabled": True, "positions_per_shard": "all"}},
        )
        rounds["wf"] = wf
        wf.run(timeout=900)  # the README's command: the whole pipeline
        rounds["tp1"] = collect(wf, "tp 1", server)
        rounds["manifest"] = json.loads(wf.path(MANIFEST).read_text())
        rounds["generated"] = wf.responses(DATASET)

        args = [MANIFEST, "--forcerun", "hidden_states"]
        rounds["killed_log"] = run_until_a_batch_then_kill(wf, args)
        rounds["after_kill"] = leftovers(server)
        rounds["engines_after_kill"] = engines_after(wf)
        rounds["shard_after_kill"] = sorted(p.name for p in wf.path(RESULTS).glob("shard-*"))
        wf.run("--unlock")
        wf.run(*args, timeout=900)
        rounds["resumed"] = collect(wf, "resumed", server)

        rounds["dtype_error"] = dtype_mismatch(model_dir, server)
        rounds["layers_error"] = layers_mismatch(model_dir, server)
        rounds["post"] = recapture(wf, server, "post-norm", final_state="post_norm")
    with capture_server(base, model_dir, "tp2", tp=2) as server:
        rounds["tp2"] = recapture(wf, server, "tp 2", final_state="pre_norm")
        rounds["tp2_server_log"] = server.log_text()
    yield rounds


def dtype_mismatch(model_dir: Path, server: VLLMServer) -> str:
    """What the capture says when the config's dtype is not the server's, and that it
    said it before capturing anything (nothing left in the storage)."""
    with pytest.raises(VLLMCaptureError) as caught:
        VLLMCapture(str(model_dir), dtype="bfloat16", options={"url": server.url})
    assert leftovers(server) == []
    return str(caught.value)


def layers_mismatch(model_dir: Path, server: VLLMServer) -> str:
    """What the capture says when the server was started with other layers than the
    config's (here: the config asks other aux layers of the same server), before any work."""
    with pytest.raises(VLLMCaptureError) as caught:
        VLLMCapture(str(model_dir), dtype=DTYPE, aux_layers=[0, 2, 5], options={"url": server.url})
    assert leftovers(server) == []
    return str(caught.value)


def test_a_server_started_with_other_layers_is_refused_before_any_work(
    llama: dict[str, Any],
) -> None:
    """vLLM answers four layers of the right width whatever layers it was started with;
    its storage folder, named after them by the printed command, says which."""
    message: str = llama["layers_error"]
    assert "\n" not in message
    assert f"states layers {vllm_layer_ids(AUX)}" in message, message
    assert "this config captures layers [1, 3, 6, 8]" in message, message


def test_one_server_generates_and_captures(llama: dict[str, Any]) -> None:
    tp1: Round = llama["tp1"]
    assert len(llama["generated"]) == PROMPTS
    assert all(r["finish_reason"] in ("stop", "length") for r in llama["generated"])
    assert len(tp1.states) == PROMPTS and tp1.final_state == "pre_norm"
    check_against_the_target(reference(llama["model"]), tp1)
    manifest = llama["manifest"]
    assert manifest["num_samples"] == PROMPTS
    check = manifest["agreement"]
    print(f"agreement {check['agreement']} (control {check['control_agreement']})")
    assert check["greedy"] and check["positions"] > 100
    assert check["agreement"] >= 0.9 > 0.1 >= check["control_agreement"], check
    # The generate job deleted the files of its requests, the capture those of its own.
    assert tp1.leftovers == []
    assert "vllm capture server" in tp1.logs
    # The shard jobs' client of the server is the run's capture engine.
    assert tp1.logs.count("started capture engine") == 1, tp1.logs


def test_kill_9_in_the_middle_of_a_shard_then_the_same_command_is_byte_identical(
    llama: dict[str, Any],
) -> None:
    killed_log: str = llama["killed_log"]
    done = [int(n) for n, _ in re.findall(r"batch (\d+)/(\d+)", killed_log)]
    total = int(re.findall(r"batch \d+/(\d+)", killed_log)[0])
    assert max(done) < total, f"the kill came after the last batch:\n{killed_log[-2000:]}"
    assert llama["shard_after_kill"] == [], "no shard (nor a partial one) after the kill"
    resumed: Round = llama["resumed"]
    assert resumed.shards == llama["tp1"].shards
    # The killed attempt's requests still finished on the server and were written; the
    # resumed job deleted them.
    print(f"files left by the kill: {len(llama['after_kill'])}")
    assert resumed.leftovers == []
    assert llama["engines_after_kill"] == [], "the capture engine outlived its killed run"


def test_post_norm_is_the_targets_own_norm_of_the_pre_norm_state(llama: dict[str, Any]) -> None:
    post: Round = llama["post"]
    tp1: Round = llama["tp1"]
    assert post.final_state == "post_norm"
    check_against_the_target(reference(llama["model"]), post)
    for sample_id, (aux, last, _) in post.states.items():
        assert torch.equal(aux, tp1.states[sample_id][0])
        assert not torch.allclose(last, tp1.states[sample_id][1], atol=1e-3)


def test_tensor_parallel_2_captures_the_same_states(llama: dict[str, Any]) -> None:
    tp2: Round = llama["tp2"]
    assert "world_size=2" in llama["tp2_server_log"]
    check_against_the_target(reference(llama["model"]), tp2)
    assert tp2.leftovers == []
    for sample_id, (aux, _, _) in tp2.states.items():
        cos = torch.nn.functional.cosine_similarity(aux, llama["tp1"].states[sample_id][0], -1)
        assert cos.min().item() > MIN_COSINE


def test_a_server_in_another_dtype_fails_before_any_work_in_one_line(
    llama: dict[str, Any],
) -> None:
    message: str = llama["dtype_error"]
    assert "\n" not in message
    assert "computes in float32, but hidden_states.dtype is bfloat16" in message
    assert "--dtype bfloat16" in message


# --- Qwen3 ------------------------------------------------------------------------------


def test_qwen3_states_match_transformers(tmp_path: Path) -> None:
    model_dir = make_qwen3_dir(tmp_path / "tiny-qwen3", head_dim=HEAD_DIM)
    prompts = write_prompts(tmp_path / "prompts.jsonl", sharegpt_prompts(6))
    with capture_server(tmp_path, model_dir, "qwen3") as server:
        wf = new_workflow(
            tmp_path,
            model_dir,
            {DATASET: {"path": str(prompts), "format": "sharegpt"}},
            model={"chat_template_kwargs": {"enable_thinking": False}},
            generation={"sampling": {"temperature": 0.0, "max_tokens": 24}},
            hidden_states=capture_settings(server),
        )
        wf.run(MANIFEST, timeout=900)
        rnd = collect(wf, "qwen3", server)
    # Qwen3's template renders history differently: a sample per assistant turn.
    assert len(rnd.states) >= 6
    check_against_the_target(reference(model_dir), rnd)
    assert rnd.leftovers == []


# --- Kimi-K2.5's shape --------------------------------------------------------------------


def test_kimi_shaped_target_states_match_transformers(tmp_path: Path) -> None:
    """DeepSeek-V3's MLA attention with K2.5's head dimensions, its router and experts,
    Kimi's remote-code tokenizer: vLLM's reference CPU MLA backend (``CPU_MLA``; where torch
    reports AMX vLLM picks its AMX-only one, which needs bf16) captures it, the final
    layer's state included (vLLM issue 48124: DeepSeek-, Kimi- and GLM-MoE models dropped
    it in earlier versions)."""
    model_dir = make_kimi_dir(tmp_path / "Kimi-K2.5-tiny", k25_attention=True)
    depth = num_hidden_layers(read_model_config(model_dir))
    assert resolve_aux_layers("auto", depth, "layer_output") == AUX
    prompts = write_prompts(tmp_path / "prompts.jsonl", sharegpt_prompts(4))
    tiktoken = {"TIKTOKEN_CACHE_DIR": str(tmp_path / "tiktoken-cache")}
    mla = ["--trust-remote-code", "--attention-backend", "CPU_MLA", "--max-model-len", "2048"]
    with capture_server(tmp_path, model_dir, "kimi", extra=mla, env=tiktoken) as server:
        wf = new_workflow(
            tmp_path,
            model_dir,
            {DATASET: {"path": str(prompts), "format": "sharegpt"}},
            model={"trust_remote_code": True, "chat_template_kwargs": {"thinking": False}},
            generation={"sampling": {"temperature": 0.0, "max_tokens": 24}},
            hidden_states=capture_settings(server),
        )
        wf.env.update(tiktoken)
        wf.run(MANIFEST, timeout=900)
        rnd = collect(wf, "kimi", server)
    assert len(rnd.states) >= 4
    check_against_the_target(kimi_text_decoder(model_dir).float().eval(), rnd)
    assert rnd.leftovers == []
