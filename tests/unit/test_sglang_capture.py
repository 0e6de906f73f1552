"""The SGLang hidden-state backend on CPU: everything but the engine itself.

A small fake stands in for ``sglang.Engine``: it returns what sglang 0.5.23's
``Engine.generate(..., return_hidden_states=True)`` returns (``meta_info`` with
``prompt_tokens``, ``cached_tokens`` and ``hidden_states = [prefill rows]``, each
row ``[aux | last]`` once our forward hook has run). The real engine is checked
by tests/gpu/check_sglang.py on a GPU machine.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml
from support.settings import capture_settings
from support.workflow import REPO

from eagle3data.hidden_states import handoff
from eagle3data.hidden_states.backends import build_extractor
from eagle3data.hidden_states.final_state import POST_NORM
from eagle3data.hidden_states.layers import AuxLayers, resolve_aux_layers
from eagle3data.hidden_states.settings import CaptureSettings
from eagle3data.hidden_states.sglang_capture import (
    SGLangCapture,
    SGLangCaptureError,
    engine_kwargs,
    sglang_layer_ids,
)
from eagle3data.hidden_states.sglang_engine import start_engine, workers_write_to_job_log
from eagle3data.hidden_states.sglang_hooks import (
    FINAL_NORM_MODULES,
    HOOK_FACTORY,
    PRE_NORM_HOOK_FACTORY,
    SHARED_HOOK_FACTORY,
    append_last_hidden_states_hook,
    shared_rows_hook,
    split_states,
)

HIDDEN = 8
LAYERS = 10


def rows_for(ids: list[int], width: int) -> torch.Tensor:
    """Deterministic bf16-representable states: row t of a sample depends on (id, t)."""
    t = torch.arange(len(ids), dtype=torch.float32)[:, None]
    col = torch.arange(width, dtype=torch.float32)[None, :]
    tok = torch.tensor(ids, dtype=torch.float32)[:, None]
    return ((tok * 0.5 + t * 0.25 - col * 0.125) / 8).to(torch.bfloat16)


def stand_in_norm(pre: torch.Tensor) -> torch.Tensor:
    """The fake model's final norm: any function that changes the state will do."""
    return (pre * 2 - 1).to(pre.dtype)


def run_hook(kwargs: dict[str, Any], aux: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """What sglang does with our ``forward_hooks`` specs around one forward batch:
    ``hook_manager.register_forward_hooks`` resolves each factory and calls it with the
    spec's config. The final norm runs first, as SGLang's fused add-and-norm: called with
    ``(x, residual)``, it overwrites ``x`` with the normed state and returns ``(normed,
    x + residual)``; then the logits processor, whose output carries the batch's aux rows
    and the post-norm rows."""
    post = stand_in_norm(pre)
    output = SimpleNamespace(hidden_states=aux, last_hidden_states=post)
    by_module = {"norm": [], "logits": []}
    for spec in kwargs["forward_hooks"]:
        module_name, attr = spec["hook_factory"].split(":")
        hook = getattr(importlib.import_module(module_name), attr)(spec.get("config") or {})
        kind = "norm" if spec["target_modules"] == FINAL_NORM_MODULES else "logits"
        by_module[kind].append(hook)
    for hook in by_module["norm"]:
        hook(None, (post.clone(), torch.zeros_like(pre)), (post.clone(), pre.clone()))
    for hook in by_module["logits"]:
        hook(None, (), output)
    return output.hidden_states


class FakeEngine:
    """What the capture needs from sglang.Engine; ``drop_rows`` mimics a radix-cache hit.

    Like sglang 0.5.23 it runs the registered hook once per forward batch (all requests'
    rows concatenated) and returns each request's slice of ``hidden_states`` as
    ``.tolist()`` (``batch_result_processor._append_prefill_hidden_states``).
    """

    def __init__(self, kwargs: dict[str, Any], *, drop_rows: int = 0, cached: int = 0) -> None:
        self.kwargs = dict(kwargs)
        self.calls: list[dict[str, Any]] = []
        self.drop_rows = drop_rows
        self.cached = cached
        self.closed = False

    def generate(self, **request: Any) -> list[dict[str, Any]]:
        self.calls.append(request)
        batch = [rows_for(ids, 4 * HIDDEN) for ids in request["input_ids"]]
        joined = torch.cat(batch)
        returned = run_hook(self.kwargs, joined[:, : 3 * HIDDEN], joined[:, 3 * HIDDEN :])
        out, offset = [], 0
        for ids in request["input_ids"]:
            rows = returned[offset : offset + len(ids)][self.drop_rows :]
            offset += len(ids)
            out.append(
                {
                    "output_ids": [0],
                    "meta_info": {
                        "prompt_tokens": len(ids),
                        "cached_tokens": self.cached,
                        "hidden_states": [rows.tolist()],
                    },
                }
            )
        return out

    def shutdown(self) -> None:
        self.closed = True


@pytest.fixture(autouse=True)
def handoff_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The hand-off's ``auto`` directory, here per test instead of the machine's /dev/shm."""
    root = tmp_path / "shm"
    root.mkdir()
    monkeypatch.setattr(handoff, "default_root", lambda: root)
    return root


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": LAYERS,
        "hidden_size": HIDDEN,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def make_capture(
    model_dir: Path,
    options: dict[str, Any] | None = None,
    final_state: str = "pre_norm",
    **kwargs: Any,
) -> tuple[SGLangCapture, list[FakeEngine]]:
    engines: list[FakeEngine] = []

    def factory(engine_args: dict[str, Any]) -> FakeEngine:
        engines.append(FakeEngine(engine_args, **kwargs))
        return engines[-1]

    capture = SGLangCapture(
        str(model_dir), options=options, engine_factory=factory, final_state=final_state
    )
    return capture, engines


# --- layer ids ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "layer_output", "expected"),
    [
        # llama.py: layers_to_capture = [id + 1 ...] always.
        ("LlamaForCausalLM", (1, 29, 57), [1, 29, 57]),
        ("Qwen3ForCausalLM", (2, 20, 50), [2, 20, 50]),
        # deepseek_v2.py (Kimi-K2.x): +1 only when the first id is 1, else as is.
        ("DeepseekV3ForCausalLM", (1, 29, 57), [1, 29, 57]),
        ("DeepseekV3ForCausalLM", (2, 30, 57), [3, 31, 58]),
        ("KimiK25ForConditionalGeneration", (3, 29, 57), [4, 30, 58]),
    ],
)
def test_sglang_layer_ids_capture_the_requested_layer_outputs(arch, layer_output, expected):
    aux = AuxLayers(layer_output, 61)
    ids = sglang_layer_ids(aux, [arch])
    assert ids == expected
    # What sglang's set_eagle3_layers_to_capture then captures: the input of layer j,
    # which is the output of layer j - 1 = the layer_output ids we asked for.
    first_id_rule = arch.startswith(("Deepseek", "Kimi"))
    captured_inputs = ids if first_id_rule and ids[0] != 1 else [i + 1 for i in ids]
    assert [j - 1 for j in captured_inputs] == list(layer_output)


def test_layer_zero_cannot_be_expressed_for_first_id_rule_models():
    with pytest.raises(SGLangCaptureError, match="layer 0's output is not expressible"):
        sglang_layer_ids(AuxLayers((0, 29, 57), 61), ["DeepseekV3ForCausalLM"])
    assert sglang_layer_ids(AuxLayers((0, 29, 57), 61), ["LlamaForCausalLM"]) == [0, 29, 57]


def test_hidden_states_index_config_reaches_sglang_as_layer_outputs():
    aux = resolve_aux_layers([2, 30, 58], 61, "hidden_states_index")
    assert sglang_layer_ids(aux, ["LlamaForCausalLM"]) == [1, 29, 57]


# --- engine arguments ---------------------------------------------------------------


def test_engine_kwargs_turn_off_what_would_shorten_the_rows():
    kwargs = engine_kwargs(
        "/m", dtype="bfloat16", layer_ids=[1, 4, 6], options={"tp_size": 8, "ep_size": 8}
    )
    assert kwargs["disable_radix_cache"] is True
    assert kwargs["chunked_prefill_size"] == -1
    # The hook that adds the final-norm rows must run: prefills stay eager.
    assert kwargs["disable_prefill_cuda_graph"] is True
    assert kwargs["enable_return_aux_hidden_states"] is True
    assert kwargs["speculative_algorithm"] == "EAGLE3"
    assert kwargs["return_aux_hidden_state_layer_ids"] == [1, 4, 6]
    assert (kwargs["tp_size"], kwargs["ep_size"]) == (8, 8)
    assert (kwargs["dp_size"], kwargs["enable_dp_attention"]) == (1, False)
    assert kwargs["mem_fraction_static"] == 0.8
    norm_hook, hook = kwargs["forward_hooks"]
    assert hook["hook_factory"] == HOOK_FACTORY
    assert hook["target_modules"] == ["logits_processor", "*.logits_processor"]
    assert hook["config"] == {"final_state": "pre_norm"}
    # The default final state is the norm's input: a hook on the final norm keeps it.
    assert norm_hook["hook_factory"] == PRE_NORM_HOOK_FACTORY
    assert norm_hook["target_modules"] == ["model.norm", "*.model.norm"]


def test_extra_args_pass_through_but_cannot_undo_the_capture_settings():
    kwargs = engine_kwargs(
        "/m",
        dtype="bfloat16",
        layer_ids=[1, 2, 3],
        options={"extra_args": {"attention_backend": "fa3"}},
    )
    assert kwargs["attention_backend"] == "fa3"
    with pytest.raises(SGLangCaptureError, match=r"may not set \['disable_radix_cache'\]"):
        engine_kwargs(
            "/m",
            dtype="bfloat16",
            layer_ids=[1, 2, 3],
            options={"extra_args": {"disable_radix_cache": False}},
        )


def test_device_cpu_asks_for_sglangs_cpu_engine(monkeypatch):
    kwargs = engine_kwargs("/m", dtype="bfloat16", layer_ids=[1, 2, 3], options={}, device="cpu")
    assert kwargs["device"] == "cpu"
    assert "device" not in engine_kwargs("/m", dtype="bfloat16", layer_ids=[1, 2, 3], options={})
    # SGLang picks its CPU platform from SGLANG_USE_CPU_ENGINE alone, at import.
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    monkeypatch.setitem(sys.modules, "sglang", SimpleNamespace(Engine=lambda **kw: kw))
    assert start_engine(kwargs)["device"] == "cpu"
    assert os.environ["SGLANG_USE_CPU_ENGINE"] == "1"


def test_the_shard_script_survives_being_rerun_by_spawned_workers():
    # SGLang starts its scheduler with the spawn method, which re-runs the job's main file as
    # __mp_main__, where Snakemake's `snakemake` object does not exist.
    runpy.run_path(str(REPO / "scripts" / "extract_hidden_states.py"), run_name="__mp_main__")


def test_a_failed_engine_start_leaves_no_context_that_blocks_the_exit(model_dir, tmp_path):
    zmq = pytest.importorskip("zmq")  # SGLang's messaging; installed with it
    # What a dead scheduler leaves: a socket holding a message for a peer that never came.
    context = zmq.Context(2)
    sender = context.socket(zmq.PUSH)
    sender.connect(f"ipc://{tmp_path}/never-bound")
    sender.send(b"to a scheduler that died", zmq.NOBLOCK)

    def dead_scheduler(_kwargs):
        raise RuntimeError("Rank 0 scheduler died during initialization (exit code: 1)")

    with pytest.raises(RuntimeError, match="scheduler died"):
        SGLangCapture(str(model_dir), options={"handoff": "lists"}, engine_factory=dead_scheduler)
    assert context.closed  # else the interpreter's exit waits on it forever


def test_workers_started_in_the_block_write_to_the_job_log(tmp_path):
    from eagle3data.jobs import setup_logging

    log_path = tmp_path / "job.log"
    setup_logging(str(log_path))
    worker = [sys.executable, "-c", "import sys; sys.stderr.write('worker traceback\\n')"]
    try:
        with workers_write_to_job_log():
            subprocess.run(worker, check=True)  # inherits stderr, as SGLang's workers do
            logging.basicConfig(format="%(message)s", force=True)  # as SGLang's engine does
        subprocess.run(worker, check=True, capture_output=True)
        logging.getLogger("eagle3data").info("a line after the engine started")
    finally:
        setup_logging(None)
    text = log_path.read_text()
    assert text.count("worker traceback") == 1
    assert "a line after the engine started" in text


def test_hook_factory_path_resolves_like_sglang_resolves_it():
    # sglang's hook_manager.resolve_callable: "module:attr" -> import_module + getattr.
    module_name, attr = HOOK_FACTORY.split(":")
    assert getattr(importlib.import_module(module_name), attr) is append_last_hidden_states_hook


def test_hook_appends_the_final_norm_rows_to_the_aux_rows():
    hook = append_last_hidden_states_hook({"final_state": POST_NORM})
    aux = torch.randn(5, 3 * HIDDEN, dtype=torch.bfloat16)
    last = torch.randn(5, HIDDEN, dtype=torch.bfloat16)
    output = SimpleNamespace(hidden_states=aux, last_hidden_states=last)
    assert hook(None, (), output) is None  # modifies in place
    assert torch.equal(output.hidden_states, torch.cat([aux, last], dim=-1))
    assert output.last_hidden_states is None
    # Decode steps, or no aux capture: nothing to append, output untouched.
    untouched = SimpleNamespace(hidden_states=aux, last_hidden_states=None)
    hook(None, (), untouched)
    assert untouched.hidden_states is aux


# --- conversions and checks ---------------------------------------------------------


def test_split_states_is_lossless_in_bf16():
    ids = [5, 9, 2, 7]
    rows = rows_for(ids, 4 * HIDDEN)
    out = {"meta_info": {"prompt_tokens": 4, "hidden_states": [rows.float().tolist()]}}
    aux, last = split_states(out, 4, HIDDEN, torch.bfloat16)
    assert aux.dtype == last.dtype == torch.bfloat16
    assert aux.shape == (4, 3 * HIDDEN) and last.shape == (4, HIDDEN)
    assert torch.equal(torch.cat([aux, last], dim=-1), rows)


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        (
            {"prompt_tokens": 4, "hidden_states": [[[0.0] * 32] * 3]},
            "3 hidden-state rows for a 4-token",
        ),
        (
            {"prompt_tokens": 4, "cached_tokens": 2, "hidden_states": [[[0.0] * 32] * 4]},
            "cached_tokens=2",
        ),
        (
            {"prompt_tokens": 4, "hidden_states": [[[0.0] * 24] * 4]},
            "24 values per token, expected",
        ),
        ({"prompt_tokens": 4}, "returned no hidden states"),
    ],
)
def test_split_states_refuses_what_is_not_one_full_row_per_token(meta, match):
    with pytest.raises(SGLangCaptureError, match=match):
        split_states({"meta_info": meta}, 4, HIDDEN, torch.bfloat16)


# --- the capture with a fake engine -------------------------------------------------


@pytest.mark.parametrize("handoff_name", ["shared_memory", "lists"])
def test_capture_has_the_extractor_interface(model_dir, handoff_root, handoff_name):
    capture, (engine,) = make_capture(model_dir, {"handoff": handoff_name})
    assert capture.aux.layer_ids == (1, 4, 6)  # [1, L//2-1, L-4] for L=10
    assert capture.hidden_size == HIDDEN
    assert capture.dtype == torch.bfloat16
    assert engine.kwargs["return_aux_hidden_state_layer_ids"] == [1, 4, 6]
    assert engine.kwargs["dtype"] == "bfloat16"
    assert engine.kwargs["model_path"] == str(model_dir)

    samples = [[3, 1, 4, 1, 5], [9, 2]]
    out = capture.forward(samples)
    (call,) = engine.calls
    assert call["input_ids"] == samples
    assert call["sampling_params"] == {"max_new_tokens": 1, "temperature": 0.0}
    assert call["return_hidden_states"] is True
    for (aux, last), ids in zip(out, samples, strict=True):
        expected = rows_for(ids, 4 * HIDDEN)
        assert aux.device.type == "cpu"
        assert torch.equal(aux, expected[:, : 3 * HIDDEN])
        assert torch.equal(last, expected[:, 3 * HIDDEN :])
    capture.close()
    assert engine.closed
    assert list(handoff_root.iterdir()) == []  # the hand-off memory is given back
    capture.close()  # again at exit: harmless


@pytest.mark.parametrize("handoff_name", ["shared_memory", "lists"])
def test_post_norm_capture_returns_what_the_logits_processor_holds(model_dir, handoff_name):
    capture, (engine,) = make_capture(model_dir, {"handoff": handoff_name}, "post_norm")
    assert capture.final_state == "post_norm"
    (spec,) = engine.kwargs["forward_hooks"]  # no hook on the final norm
    assert spec["config"]["final_state"] == "post_norm"
    samples = [[3, 1, 4, 1, 5], [9, 2]]
    for (aux, last), ids in zip(capture.forward(samples), samples, strict=True):
        expected = rows_for(ids, 4 * HIDDEN)
        assert torch.equal(aux, expected[:, : 3 * HIDDEN])
        assert torch.equal(last, stand_in_norm(expected[:, 3 * HIDDEN :]))
    capture.close()


def test_an_idle_forward_hands_over_no_rows_and_leaves_nothing_behind():
    """A data-parallel attention group with no request this step: SGLang skips the final
    norm (no pre-norm rows) and the logits processor holds zero rows (seen on its CPU
    engine at dp 2)."""
    from eagle3data.hidden_states import sglang_hooks

    sglang_hooks._pre_norm_rows[:] = [torch.ones(2, HIDDEN)]  # a stale one: dropped
    idle = SimpleNamespace(
        hidden_states=torch.zeros(0, 3 * HIDDEN), last_hidden_states=torch.zeros(0, HIDDEN)
    )
    aux, last = sglang_hooks._captured_parts(idle, "pre_norm")
    assert aux.shape == (0, 3 * HIDDEN) and last.shape == (0, HIDDEN)
    assert sglang_hooks._pre_norm_rows == []


def test_a_pre_norm_capture_whose_norm_hook_never_ran_fails(model_dir):
    """A model whose final norm is not at the names hooked: the worker raises rather than
    hand over the post-norm state as pre-norm."""
    capture, (engine,) = make_capture(model_dir, {"handoff": "lists"})
    engine.kwargs["forward_hooks"] = engine.kwargs["forward_hooks"][1:]
    with pytest.raises(SGLangCaptureError, match=r"final norm's input of this forward was not"):
        capture.forward([[3, 1, 4]])
    capture.close()


def test_capture_raises_when_the_engine_computed_only_part_of_a_prompt(model_dir):
    capture, _ = make_capture(model_dir, drop_rows=2)
    with pytest.raises(SGLangCaptureError, match="3 hidden-state rows for a 5-token sample"):
        capture.forward([[3, 1, 4, 1, 5]])


# --- the factory and the config -----------------------------------------------------


def capture(**overrides: Any) -> CaptureSettings:
    sglang = {"tp_size": 2, "ep_size": 2, "mem_fraction_static": 0.7, "extra_args": {}}
    return capture_settings(**{"device": "cpu", "sglang": sglang, **overrides})


def test_factory_builds_the_sglang_backend_with_the_configured_options(model_dir):
    engines: list[FakeEngine] = []
    extractor = build_extractor(
        str(model_dir),
        capture(backend="sglang", dtype="float16"),
        sglang_engine_factory=lambda kw: engines.append(FakeEngine(kw)) or engines[-1],
    )
    assert isinstance(extractor, SGLangCapture)
    assert extractor.dtype == torch.float16
    (engine,) = engines
    assert (engine.kwargs["tp_size"], engine.kwargs["ep_size"]) == (2, 2)
    assert engine.kwargs["mem_fraction_static"] == 0.7
    assert engine.kwargs["dtype"] == "float16"
    # What the shards' capture fingerprint says of this engine: the layout it was given.
    captured = extractor.capture_fingerprint()
    assert captured["engine"].startswith("sglang ")
    assert captured["layout"].startswith("tp 2, dp 1, ep 2")
    assert "layers asked for" in captured["aux_layers_confirmed_by"]


def test_the_transformers_backend_says_what_captured_the_states(tiny_model_dir):
    import transformers

    extractor = build_extractor(str(tiny_model_dir), capture(dtype="float32"))
    assert extractor.capture_fingerprint() == {
        "engine": f"transformers {transformers.__version__}",
        "layout": "cpu",
        "aux_layers_confirmed_by": "forward hooks on those decoder layers",
    }


def test_factory_builds_the_transformers_backend(tiny_model_dir):
    from eagle3data.hidden_states.transformers_capture import HiddenStateExtractor

    extractor = build_extractor(str(tiny_model_dir), capture(dtype="float32"))
    assert isinstance(extractor, HiddenStateExtractor)
    ((aux, last),) = extractor.forward([[1, 2, 3]])
    assert aux.shape == (3, 3 * 64) and last.shape == (3, 64)


def test_factory_rejects_an_unknown_backend(model_dir):
    with pytest.raises(ValueError, match="must be one of"):
        # The schema refuses it first; a settings object made by hand gets this.
        build_extractor(str(model_dir), dataclasses.replace(capture(), backend="tensorrt-llm"))


def test_without_sglang_installed_the_error_says_how_to_install_it(model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang -> ImportError
    with pytest.raises(SGLangCaptureError, match=r"pip install -e '\.\[gpu\]'"):
        SGLangCapture(str(model_dir))


def test_schema_accepts_the_sglang_backend_and_fills_its_defaults():
    from snakemake.utils import validate

    schema = REPO / "config" / "schema.yaml"
    config = {
        "model": {"path": "/m"},
        "datasets": {"A1": {"path": "a.jsonl", "format": "prompt"}},
        "hidden_states": {"backend": "sglang", "sglang": {"tp_size": 8}},
    }
    validate(config, str(schema))
    hidden = config["hidden_states"]
    assert hidden["gpus_per_job"] == "auto"
    assert hidden["sglang"] == {
        "tp_size": 8,
        "ep_size": 1,
        "dp_size": 1,
        "enable_dp_attention": False,
        "mem_fraction_static": 0.8,
        "handoff": "shared_memory",
        "handoff_dir": "auto",
        "extra_args": {},
    }
    assert config["gpus"] == {"count": "auto", "lock_timeout_s": 600}
    assert config["generation"]["gpus_per_job"] == "auto"
    from eagle3data.hidden_states.backends import BACKENDS

    assert yaml.safe_load(schema.read_text())["properties"]["hidden_states"]["properties"][
        "backend"
    ]["enum"] == list(BACKENDS)


def test_transformers_backend_on_cpu_ignores_a_multi_gpu_count(tiny_model_dir):
    from eagle3data.target import load_causal_lm

    model, _ = load_causal_lm(
        str(tiny_model_dir), dtype="float32", device="cpu", gpus=4, trust_remote_code=False
    )
    assert model.device.type == "cpu"
    assert getattr(model, "hf_device_map", None) is None  # no accelerate dispatch on CPU


# --- the shared-memory hand-off -----------------------------------------------------


def test_shared_hook_factory_path_resolves_like_sglang_resolves_it():
    module_name, attr = SHARED_HOOK_FACTORY.split(":")
    assert getattr(importlib.import_module(module_name), attr) is shared_rows_hook


def test_engine_kwargs_with_a_handoff_dir_register_the_shared_hook():
    kwargs = engine_kwargs(
        "/m", dtype="bfloat16", layer_ids=[1, 4, 6], options={}, handoff_dir="/d"
    )
    _, hook = kwargs["forward_hooks"]
    assert hook["hook_factory"] == SHARED_HOOK_FACTORY
    assert hook["config"] == {"directory": "/d", "final_state": "pre_norm"}
    # Our own options are not ServerArgs fields: sglang would reject them.
    assert "handoff" not in kwargs and "handoff_dir" not in kwargs


def test_capture_hands_states_over_as_views_that_outlive_the_files(model_dir, handoff_root):
    capture, (engine,) = make_capture(model_dir)
    (directory,) = handoff_root.iterdir()
    assert directory.name.startswith(f"{handoff.DIR_PREFIX}{os.getpid()}-")
    _, spec = engine.kwargs["forward_hooks"]
    assert spec["config"] == {"directory": str(directory), "final_state": "pre_norm"}
    samples = [[3, 1, 4], [9, 2, 6, 5]]
    first = capture.forward(samples)
    second = capture.forward([[7, 7]])
    # Each forward's batch files are unlinked once its rows are resolved...
    assert list(directory.glob("*.rows")) == []
    # ...while the rows handed out stay readable until the shard writer drops them.
    for (aux, last), ids in zip(first + second, [*samples, [7, 7]], strict=True):
        expected = rows_for(ids, 4 * HIDDEN)
        assert aux.dtype == torch.bfloat16
        assert torch.equal(torch.cat([aux, last], dim=-1), expected)
    capture.close()
    assert list(handoff_root.iterdir()) == []


def test_an_unknown_handoff_is_refused(model_dir):
    with pytest.raises(SGLangCaptureError, match=r"handoff must be one of \['shared_memory'"):
        make_capture(model_dir, {"handoff": "pipes"})


def test_a_handoff_dir_that_is_not_a_directory_is_refused(model_dir, tmp_path):
    with pytest.raises(SGLangCaptureError, match=r"handoff_dir .* is not a directory"):
        make_capture(model_dir, {"handoff_dir": str(tmp_path / "missing")})


def test_too_little_shared_memory_fails_before_the_engine_starts(
    model_dir, handoff_root, monkeypatch
):
    usage = shutil.disk_usage(handoff_root)
    monkeypatch.setattr(handoff.shutil, "disk_usage", lambda _path: usage._replace(free=10 * 2**20))
    started: list[Any] = []
    with pytest.raises(SGLangCaptureError, match=r"10 MiB free.*--shm-size.*handoff_dir"):
        SGLangCapture(
            str(model_dir),
            batch_tokens=2**20,  # two batches of 1 Mi tokens x 32 bf16 values: 128 MiB
            engine_factory=lambda kw: started.append(kw),
        )
    assert started == []
    assert list(handoff_root.iterdir()) == []  # nothing left behind


def test_a_batch_larger_than_the_free_memory_is_refused_and_cleans_up(
    model_dir, handoff_root, monkeypatch
):
    capture, (engine,) = make_capture(model_dir)
    usage = shutil.disk_usage(handoff_root)
    monkeypatch.setattr(handoff.shutil, "disk_usage", lambda _path: usage._replace(free=100))
    with pytest.raises(SGLangCaptureError, match="a batch of 5 tokens"):
        capture.forward([[3, 1, 4, 1, 5]])
    assert engine.closed and engine.calls == []
    assert list(handoff_root.iterdir()) == []


def test_a_failing_engine_start_leaves_no_handoff_dir(model_dir, handoff_root):
    def broken(_kwargs: dict[str, Any]) -> Any:
        raise RuntimeError("no GPU")

    with pytest.raises(RuntimeError, match="no GPU"):
        SGLangCapture(str(model_dir), engine_factory=broken)
    assert list(handoff_root.iterdir()) == []


def test_stale_dirs_of_dead_jobs_are_removed_live_ones_kept(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    stale = tmp_path / f"{handoff.DIR_PREFIX}{int(dead.stdout)}-abc"
    live = tmp_path / f"{handoff.DIR_PREFIX}{os.getppid()}-def"
    other = tmp_path / "someone-else"
    for d in (stale, live, other):
        d.mkdir()
        (d / "00000000.rows").write_bytes(b"x" * 16)
    fresh = handoff.make_dir(tmp_path)
    assert not stale.exists()
    assert live.exists() and other.exists() and fresh.is_dir()


def _hook_output(rows: torch.Tensor) -> SimpleNamespace:
    return SimpleNamespace(
        hidden_states=rows[:, : 3 * HIDDEN], last_hidden_states=rows[:, 3 * HIDDEN :]
    )


def _as_worker(monkeypatch: pytest.MonkeyPatch, pid: int, label: str, attn_tp_rank: int) -> None:
    """The hook's view of the process it runs in, as one SGLang worker of a layout."""
    rank = handoff.WorkerRank(pid, label, attn_tp_rank)
    monkeypatch.setattr(handoff.WorkerRank, "of_this_process", classmethod(lambda cls: rank))


def test_only_the_first_rank_of_a_tensor_parallel_group_writes(tmp_path, monkeypatch):
    tmp_path = tmp_path / "handoff"
    tmp_path.mkdir()
    rows = rows_for([4, 5, 6], 4 * HIDDEN)
    outputs = []
    for pid, label, attn_tp_rank in ((101, "scheduler TP0", 0), (102, "scheduler TP1", 1)):
        _as_worker(monkeypatch, pid, label, attn_tp_rank)
        hook = shared_rows_hook({"directory": str(tmp_path), "final_state": POST_NORM})
        output = _hook_output(rows)
        hook(None, (), output)
        outputs.append(output)
    # TP1's rows are replicas of TP0's: written once, by TP0, under its pid.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "101-00000000.rows",
        "101.rank.json",
        "102.rank.json",
    ]
    assert outputs[0].hidden_states.tolist() == [[101, 0, 0], [101, 0, 1], [101, 0, 2]]
    assert outputs[1].hidden_states.shape == outputs[0].hidden_states.shape
    assert outputs[0].last_hidden_states is None
    reader = handoff.RowsReader(tmp_path, 4 * HIDDEN, torch.bfloat16)
    assert torch.equal(reader.rows(outputs[0].hidden_states.tolist(), 3), rows)
    assert reader.summary() == (
        "scheduler TP0 (pid 101) wrote 1 batch, 3 rows; "
        "scheduler TP1 (pid 102) holds replicas, wrote none"
    )
    with pytest.raises(SGLangCaptureError, match=r"scheduler TP1 \(pid 102\), a rank that"):
        reader.rows(outputs[1].hidden_states.tolist(), 3)
    reader.release()
    # Were a replica to write its rows too, the job would not take them silently.
    (tmp_path / "102-00000001.rows").write_bytes(b"")
    with pytest.raises(SGLangCaptureError, match=r"scheduler TP1 \(pid 102\) wrote rows"):
        reader.release()
    assert list(tmp_path.glob("*.rows")) == []


def test_data_parallel_attention_groups_each_write_their_own_batches(tmp_path, monkeypatch):
    """With data-parallel attention every group computes other requests, numbering its
    batches from 0: both write, and their pointers never mix."""
    batches = {201: [[1, 2, 3], [4]], 202: [[7, 8], [9, 9, 9, 9]]}
    pointers = {}
    for pid, label in ((201, "scheduler DP0 TP0"), (202, "scheduler DP1 TP1")):
        _as_worker(monkeypatch, pid, label, 0)
        hook = shared_rows_hook({"directory": str(tmp_path), "final_state": POST_NORM})
        for n, ids in enumerate(batches[pid]):
            output = _hook_output(rows_for(ids, 4 * HIDDEN))
            hook(None, (), output)
            pointers[pid, n] = output.hidden_states.tolist()
    reader = handoff.RowsReader(tmp_path, 4 * HIDDEN, torch.bfloat16)
    for (pid, n), p in pointers.items():
        assert torch.equal(reader.rows(p, len(p)), rows_for(batches[pid][n], 4 * HIDDEN))
    assert reader.summary() == (
        "scheduler DP0 TP0 (pid 201) wrote 2 batches, 4 rows; "
        "scheduler DP1 TP1 (pid 202) wrote 2 batches, 6 rows"
    )


def test_pointers_that_are_not_consecutive_rows_of_one_batch_are_refused(tmp_path):
    writer = handoff.RowsWriter(tmp_path)
    rows = rows_for([1, 2, 3, 4], 4 * HIDDEN)
    writer.put([rows[:, : 3 * HIDDEN], rows[:, 3 * HIDDEN :]])
    me = float(os.getpid())
    reader = handoff.RowsReader(tmp_path, 4 * HIDDEN, torch.bfloat16)
    assert torch.equal(
        reader.rows([[me, 0.0, 1.0], [me, 0.0, 2.0]], 2), rows_for([1, 2, 3, 4], 4 * HIDDEN)[1:3]
    )
    with pytest.raises(SGLangCaptureError, match="not one forward batch's consecutive rows"):
        reader.rows([[me, 0.0, 0.0], [me, 0.0, 2.0]], 2)
    with pytest.raises(SGLangCaptureError, match="not one forward batch's consecutive rows"):
        reader.rows([[me, 0.0, 0.0], [me + 1, 0.0, 1.0]], 2)
    with pytest.raises(SGLangCaptureError, match=r"shape \[2, 3\] for a 3-token sample"):
        reader.rows([[me, 0.0, 0.0], [me, 0.0, 1.0]], 3)
    with pytest.raises(SGLangCaptureError, match=r"batch 0 of worker .* holds 4 rows"):
        reader.rows([[me, 0.0, 3.0], [me, 0.0, 4.0]], 2)
    with pytest.raises(
        SGLangCaptureError, match=r"batch 1 of worker pid .*, but .* does not exist"
    ):
        reader.rows([[me, 1.0, 0.0]], 1)
    with pytest.raises(SGLangCaptureError, match=r"pid 7, which never ran the capture hook"):
        reader.rows([[7.0, 0.0, 0.0]], 1)
    wrong_width = handoff.RowsReader(tmp_path, 3 * HIDDEN, torch.bfloat16)
    with pytest.raises(SGLangCaptureError, match="not whole rows of 24"):
        wrong_width.rows([[me, 0.0, 0.0]], 1)


def _hook_in_a_worker(directory: str, batches: list[list[int]], pointers_out: Any) -> None:
    """A stand-in for one SGLang scheduler process: runs the hook once per forward batch
    and sends back only what SGLang would (the pointers, as lists)."""
    hook = shared_rows_hook({"directory": directory, "final_state": POST_NORM})
    for ids in batches:
        output = _hook_output(rows_for(ids, 4 * HIDDEN))
        hook(None, (), output)
        pointers_out.put(output.hidden_states.tolist())


def test_rows_written_by_another_process_are_read_back_exactly(tmp_path):
    import multiprocessing

    # spawn: a fresh interpreter, as SGLang starts its schedulers.
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    batches = [[5, 9, 2, 7], [1, 1, 2, 3, 5, 8]]
    worker = context.Process(target=_hook_in_a_worker, args=(str(tmp_path), batches, queue))
    worker.start()
    pointers = [queue.get(timeout=120) for _ in batches]
    worker.join(timeout=120)
    assert worker.exitcode == 0
    reader = handoff.RowsReader(tmp_path, 4 * HIDDEN, torch.bfloat16)
    # The second batch's rows 2..5, as SGLang slices one request out of a batch.
    got = reader.rows(pointers[1][2:], 4)
    assert torch.equal(got, rows_for(batches[1], 4 * HIDDEN)[2:])
    assert torch.equal(reader.rows(pointers[0], 4), rows_for(batches[0], 4 * HIDDEN))
    reader.release()
    assert list(tmp_path.glob("*.rows")) == []
    assert torch.equal(got, rows_for(batches[1], 4 * HIDDEN)[2:])  # still mapped
