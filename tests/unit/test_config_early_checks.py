"""Checked when the config is read, before the first job: budgets as people write them
(``10M``, ``10_000_000``, ``10000000``: one budget, an integer for everything downstream),
and every key a later stage needs (the vLLM capture server's URL, the GPUs a job takes,
the aux layers against the model's depth, what SGLang's engine would refuse), each in one
line naming the key. Found only when its job runs, each of these would cost the days of
generation before it. Also the ``vllm serve`` command's parsers for a generating server."""

from __future__ import annotations

import copy
import json
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from eagle3data.config import (
    PACKAGE_SCHEMA,
    canonical_json,
    check_config,
    spell_counts,
    validate_config,
)
from eagle3data.errors import ConfigError
from eagle3data.generation.settings import generation_settings
from eagle3data.hidden_states.vllm_capture import main as print_serve_command

# Kimi-K2.5's config.json, as far as the checks read it: the wrapper's architecture and
# its DeepSeek-V3 decoder's depth and width under text_config.
K25_CONFIG = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "text_config": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "vocab_size": 163840,
        "dtype": "bfloat16",
    },
}


def _config(**sections: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"model": {"path": "m"}, "datasets": {"A": {"path": "x.jsonl"}}}
    for name, values in sections.items():
        config.setdefault(name, {}).update(values)
    return config


def _model_dir(tmp_path: Path, config: dict[str, Any] = K25_CONFIG) -> Path:
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    return out


def _refused(config: dict[str, Any]) -> str:
    """The one line ``check_config`` refuses ``config`` with (schema defaults first)."""
    with pytest.raises(ConfigError) as caught:
        check_config(validate_config(config, PACKAGE_SCHEMA))
    message = str(caught.value)
    assert "\n" not in message
    return message


# --- budgets ----------------------------------------------------------------------------


@pytest.mark.parametrize("budget", ["10M", "10m", "10_000_000", "10,000,000", 10_000_000])
def test_a_budget_is_read_in_every_spelling_as_one_integer(budget: str | int) -> None:
    config = validate_config(
        _config(datasets={"A": {"path": "x.jsonl", "token_budget": budget, "max_samples": "7k"}}),
        PACKAGE_SCHEMA,
    )
    dataset = config["datasets"]["A"]
    assert dataset["token_budget"] == 10_000_000 and type(dataset["token_budget"]) is int
    assert dataset["max_samples"] == 7000 and type(dataset["max_samples"]) is int


def test_the_snakefile_check_makes_the_budget_an_integer_too() -> None:
    """The Snakefile validates with Snakemake's own validate, then calls check_config:
    the rules' params (the rerun trigger) read the config after it."""
    from snakemake.utils import validate

    config = _config(datasets={"A": {"path": "x.jsonl", "token_budget": "10M"}})
    validate(config, str(PACKAGE_SCHEMA))
    assert config["datasets"]["A"]["token_budget"] == "10M"  # the schema lets it through
    check_config(config)
    assert config["datasets"]["A"]["token_budget"] == 10_000_000


def test_respelling_a_budget_changes_nothing_downstream() -> None:
    """10M and 10000000 give the same config, hence the same params and settings: a run
    re-runs nothing when one is written for the other."""
    seen = []
    for budget in ("10M", "10_000_000", 10_000_000):
        config = _config(datasets={"A": {"path": "x.jsonl", "token_budget": budget}})
        config = validate_config(config, PACKAGE_SCHEMA)
        seen.append((canonical_json(config), canonical_json(generation_settings(config))))
    assert seen[0] == seen[1] == seen[2]


def test_yaml_reads_underscored_budgets_as_integers() -> None:
    """What Snakemake's YAML loader does with `token_budget: 10_000_000` (YAML 1.1)."""
    assert yaml.safe_load("token_budget: 10_000_000") == {"token_budget": 10_000_000}


@pytest.mark.parametrize("budget", ["2.5", "1.0005k"])
def test_a_budget_that_is_not_a_whole_count_is_named(budget: str) -> None:
    config = _config(datasets={"A": {"path": "x.jsonl", "token_budget": budget}})
    with pytest.raises(ConfigError, match=r"datasets\.A\.token_budget: .* not a whole count"):
        validate_config(config, PACKAGE_SCHEMA)


@pytest.mark.parametrize("budget", ["10 M", "ten", "-5", "1e7", "10MB"])
def test_the_schema_refuses_what_is_not_a_count(budget: str) -> None:
    with pytest.raises(Exception, match="does not match"):
        validate_config(
            _config(datasets={"A": {"path": "x.jsonl", "token_budget": budget}}), PACKAGE_SCHEMA
        )


def test_counts_already_integers_are_left_alone() -> None:
    config = {"datasets": {"A": {"token_budget": 5, "max_samples": None}}}
    before = copy.deepcopy(config)
    assert spell_counts(config) == []
    assert config == before


# --- keys a later stage needs -------------------------------------------------------------


def test_the_vllm_capture_without_its_server_url_is_refused_before_any_job() -> None:
    """The schema has no default for it (the server is the user's): found today when the
    first shard job runs, after generation."""
    message = _refused(_config(hidden_states={"backend": "vllm"}))
    assert message.startswith("invalid config: hidden_states.vllm.url: not set")
    assert "http://localhost:8000/v1" in message


def test_a_vllm_capture_url_that_is_no_http_url_is_refused() -> None:
    config = _config(hidden_states={"backend": "vllm", "vllm": {"url": "gpu-node-1:8000/v1"}})
    assert "hidden_states.vllm.url: 'gpu-node-1:8000/v1' is not an http(s) URL" in _refused(config)


def test_a_vllm_capture_with_its_url_passes() -> None:
    url = {"url": "http://gpu-node-1:8000/v1"}
    check_config(validate_config(_config(hidden_states={"vllm": url}), PACKAGE_SCHEMA))
    config = _config(hidden_states={"backend": "vllm", "vllm": url})
    check_config(validate_config(config, PACKAGE_SCHEMA))


def test_a_job_larger_than_the_gpus_named_is_refused() -> None:
    config = _config(
        hidden_states={"backend": "sglang", "sglang": {"tp_size": 8}}, gpus={"count": 4}
    )
    message = _refused(config)
    assert "gpus.count: 4" in message and "hidden_states job takes 8 GPUs" in message


def test_fewer_gpus_per_job_than_the_sglang_layout_is_one_line() -> None:
    """It used to surface as a traceback from the rules' resources."""
    config = _config(
        hidden_states={"backend": "sglang", "gpus_per_job": 4, "sglang": {"tp_size": 8}}
    )
    assert "hidden_states.gpus_per_job=4 is less than the 8 GPUs" in _refused(config)


def test_gpu_jobs_within_the_machine_pass() -> None:
    config = _config(
        hidden_states={"backend": "sglang", "sglang": {"tp_size": 8}}, gpus={"count": 8}
    )
    check_config(validate_config(config, PACKAGE_SCHEMA))


def test_aux_layers_beyond_the_model_depth_are_refused(tmp_path: Path) -> None:
    model = _model_dir(tmp_path)
    config = _config(model={"path": str(model)}, hidden_states={"aux_layers": [1, 29, 61]})
    message = _refused(config)
    assert message.startswith("invalid config: hidden_states.aux_layers: aux layer id 61")
    assert "num_layers=61" in message and str(model / "config.json") in message


def test_the_default_rule_on_a_model_too_shallow_for_it_is_refused(tmp_path: Path) -> None:
    shallow = copy.deepcopy(K25_CONFIG)
    shallow["text_config"]["num_hidden_layers"] = 6
    model = _model_dir(tmp_path, shallow)
    assert "at least 7 decoder layers" in _refused(_config(model={"path": str(model)}))


def test_aux_layers_the_model_has_pass(tmp_path: Path) -> None:
    model = _model_dir(tmp_path)
    config = _config(model={"path": str(model)}, hidden_states={"aux_layers": [1, 29, 57]})
    check_config(validate_config(config, PACKAGE_SCHEMA))


def test_a_missing_model_directory_is_left_to_the_file_check() -> None:
    """No config.json: the Snakefile names the directory (or the demo rule makes it)."""
    config = _config(model={"path": "/nonexistent"}, hidden_states={"aux_layers": [1, 2, 99]})
    check_config(validate_config(config, PACKAGE_SCHEMA))


def test_aux_layers_sglang_cannot_request_for_kimi_are_refused(tmp_path: Path) -> None:
    """SGLang's DeepSeek-V3/Kimi models read a first id of 1 as a layer output and any other
    as an input index: layer 0's output cannot be asked for."""
    model = _model_dir(tmp_path)
    config = _config(
        model={"path": str(model)},
        hidden_states={"backend": "sglang", "aux_layers": [0, 29, 57]},
    )
    message = _refused(config)
    assert message.startswith("invalid config: hidden_states.aux_layers: aux layer outputs")
    assert "cannot be requested from SGLang" in message


def test_sglang_engine_arguments_the_capture_sets_are_refused(tmp_path: Path) -> None:
    model = _model_dir(tmp_path)
    config = _config(
        model={"path": str(model)},
        hidden_states={
            "backend": "sglang",
            "sglang": {"extra_args": {"chunked_prefill_size": 8192}},
        },
    )
    assert "hidden_states.sglang.extra_args may not set ['chunked_prefill_size']" in _refused(
        config
    )


def test_sglang_engine_arguments_of_its_own_pass(tmp_path: Path) -> None:
    model = _model_dir(tmp_path)
    config = _config(
        model={"path": str(model)},
        hidden_states={"backend": "sglang", "sglang": {"extra_args": {"attention_backend": "fa3"}}},
    )
    check_config(validate_config(config, PACKAGE_SCHEMA))


def test_every_problem_is_named_at_once(tmp_path: Path) -> None:
    """As the Snakefile checks: Snakemake's schema validation, then check_config."""
    from snakemake.utils import validate

    model = _model_dir(tmp_path)
    config = _config(
        model={"path": str(model)},
        hidden_states={"backend": "vllm", "aux_layers": [1, 29, 99]},
        datasets={"A": {"path": "x.jsonl", "token_budget": "2.5"}},
    )
    validate(config, str(PACKAGE_SCHEMA))
    with pytest.raises(ConfigError) as caught:
        check_config(config)
    message = str(caught.value)
    assert "\n" not in message
    for key in ("datasets.A.token_budget", "hidden_states.vllm.url", "hidden_states.aux_layers"):
        assert key in message


def test_a_model_config_that_says_no_depth_is_left_to_the_capture(tmp_path: Path) -> None:
    """A stand-in model (the prompt stages need no depth) does not stop a run at parse
    time; the capture names the missing depth when it reads it."""
    from eagle3data.config import model_problems

    model = _model_dir(tmp_path, {"architectures": ["LlamaForCausalLM"], "hidden_size": 64})
    hidden = {
        "backend": "transformers",
        "aux_layers": "auto",
        "aux_layer_convention": "layer_output",
    }
    assert model_problems(_config(model={"path": str(model)}, hidden_states=hidden)) == []


# --- the vllm serve command of a server that also generates -----------------------------------


def _serve_args(tmp_path: Path, capsys: Any, model_config: dict[str, Any], **gen: Any) -> list[str]:
    model = _model_dir(tmp_path, model_config)
    config = _config(
        model={"path": str(model), "trust_remote_code": True},
        hidden_states={"backend": "vllm", "vllm": {"url": "http://h:8000/v1"}},
        generation=gen,
    )
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    assert print_serve_command(["--config", str(path), "--storage", "/hs", "--", "-tp", "8"]) == 0
    return shlex.split(capsys.readouterr().out)


def test_a_generating_server_gets_kimis_reasoning_and_tool_call_parsers(
    tmp_path: Path, capsys: Any
) -> None:
    args = _serve_args(
        tmp_path, capsys, K25_CONFIG, backend="openai", endpoints=["http://h:8000/v1"]
    )
    assert args[-8:] == [
        "-tp",
        "8",
        "--trust-remote-code",
        "--reasoning-parser",
        "kimi_k2",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "kimi_k2",
    ]


def test_a_capture_only_server_gets_no_parsers(tmp_path: Path, capsys: Any) -> None:
    args = _serve_args(tmp_path, capsys, K25_CONFIG)  # generation in-process
    assert "--reasoning-parser" not in args and args[-3:] == ["-tp", "8", "--trust-remote-code"]


def test_an_unknown_target_is_said_to_need_its_own_parsers(tmp_path: Path, capsys: Any) -> None:
    llama = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 8}
    model = _model_dir(tmp_path, llama)
    config = _config(
        model={"path": str(model)},
        hidden_states={"backend": "vllm", "vllm": {"url": "http://h:8000/v1"}},
        generation={"backend": "openai", "endpoints": ["http://h:8000/v1"]},
    )
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    assert print_serve_command(["--config", str(path), "--storage", "/hs"]) == 0
    out = capsys.readouterr()
    assert "--reasoning-parser" not in out.out
    assert "no reasoning or tool-call parser is known here for ['LlamaForCausalLM']" in out.err
