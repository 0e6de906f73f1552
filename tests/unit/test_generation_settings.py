"""Which settings key a generation journal, and the rule params they make."""

from __future__ import annotations

from pathlib import Path

from eagle3data.generation.settings import (
    execution_settings,
    generation_key,
    generation_settings,
    model_fingerprint,
)
from eagle3data.hidden_states.settings import hidden_state_settings


def _config(**sampling) -> dict:
    return {
        "model": {
            "path": "m",
            "name": None,
            "dtype": "auto",
            "chat_template_kwargs": {},
            "trust_remote_code": False,
        },
        "generation": {
            "backend": "transformers",
            "batch_size": 8,
            "seed": 0,
            "device": "auto",
            "progress_interval_s": 10,
            "sampling": {"temperature": 0.0, "max_tokens": 64, **sampling},
        },
        "datasets": {"A1": {"path": "a", "format": "sharegpt", "token_budget": 10}},
    }


def test_sidecar_key_ignores_budgets_and_logging_but_not_sampling() -> None:
    base = _config()
    key = generation_key(generation_settings(base), "fp")
    changed_budget = _config()
    changed_budget["datasets"]["A1"]["token_budget"] = 99
    changed_budget["generation"]["progress_interval_s"] = 1
    changed_budget["model"]["path"] = "elsewhere/m"
    assert generation_key(generation_settings(changed_budget), "fp") == key
    assert generation_key(generation_settings(_config(temperature=0.7)), "fp") != key
    assert generation_key(generation_settings(base), "other-model") != key


def test_model_fingerprint_follows_config_tokenizer_and_weight_sizes(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    first = model_fingerprint(tmp_path)
    (tmp_path / "model.safetensors").touch()  # same content, new mtime
    assert model_fingerprint(tmp_path) == first
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "x"}')
    second = model_fingerprint(tmp_path)
    assert second != first
    (tmp_path / "model.safetensors").write_bytes(b"x" * 11)
    assert model_fingerprint(tmp_path) != second


def test_journal_keys_are_what_they_were() -> None:
    """A changed key would orphan every journal on disk (a full regeneration): the keys
    of these configs were computed before the package was restructured."""
    config = _config(temperature=0.6, top_p=0.95, top_k=-1, repetition_penalty=1.0, stop=["。"])
    config["model"]["path"] = "models/m"
    config["model"]["chat_template_kwargs"] = {"thinking": True}
    config["generation"]["sampling"]["max_tokens"] = 64
    assert generation_key(generation_settings(config), "fp") == "513f9bcc53c8b0b5"
    config["generation"].update(
        backend="openai", served_model=None, extra_body={"min_p": 0.05}, endpoints=["http://x/v1"]
    )
    assert generation_key(generation_settings(config), "fp") == "d38a2d5d478824f1"


def test_execution_settings_are_not_settings() -> None:
    config = _config()
    config["generation"].update(endpoints=["http://a/v1"], concurrency=8, device="cpu")
    execution = execution_settings(config)
    assert execution["endpoints"] == ["http://a/v1"] and execution["device"] == "cpu"
    assert not set(execution) & set(generation_settings(config))


def test_hidden_state_settings_leave_out_where_states_are_computed() -> None:
    config = {
        "model": {"dtype": "auto"},
        "hidden_states": {"dtype": "auto", "gpus_per_job": 8, "sglang": {"tp_size": 8}},
    }
    assert hidden_state_settings(config) == {"hidden_states": {"dtype": "auto"}, "dtype": "auto"}
