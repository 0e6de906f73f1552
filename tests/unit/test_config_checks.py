"""Config errors before any work: keys that cannot go together are refused when the config is
validated, and what an enabled export imports is looked up then (without importing it) and
imported by the export before it writes a file, each in one line that says what to do."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from support.workflow import REPO

from eagle3data.config import PACKAGE_SCHEMA, check_config, validate_config
from eagle3data.errors import ConfigError, UserError


def _config(**export: Any) -> dict[str, Any]:
    return {"model": {"path": "m"}, "datasets": {"A": {"path": "x.jsonl"}}, "export": export}


def _hide(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """Make ``modules`` not installed, for find_spec and import alike (a None entry in
    sys.modules is how Python marks a module that must not import)."""
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


def test_float16_with_the_speculators_export_is_refused_at_validation() -> None:
    with pytest.raises(ConfigError) as caught:
        validate_config(_config(speculators=True, dtype="float16"), PACKAGE_SCHEMA)
    message = str(caught.value)
    assert "\n" not in message
    assert "export.dtype: float16" in message and "export.speculators" in message


@pytest.mark.parametrize(
    "export", [{"speculators": True, "dtype": "bfloat16"}, {"specforge": True, "dtype": "float16"}]
)
def test_dtypes_each_export_trains_on_are_accepted(export: dict[str, Any]) -> None:
    assert validate_config(_config(**export), PACKAGE_SCHEMA)["export"]["dtype"] == export["dtype"]


def test_a_missing_speculators_is_named_when_the_config_enables_its_export(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = validate_config(_config(speculators=True), PACKAGE_SCHEMA)
    _hide(monkeypatch, "speculators", "hs_connectors")
    with pytest.raises(ConfigError) as caught:
        check_config(config)
    message = str(caught.value)
    assert "\n" not in message and "export.speculators" in message
    assert "pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0" in message
    assert "datasets" not in message  # installed: only what is missing is named


def test_with_conda_environments_the_jobs_environment_file_is_what_is_checked(
    tmp_path: Path,
) -> None:
    """Snakemake deploying conda environments: the export's job imports from the rule's
    environment, not from the Snakemake process's (where speculators is installed here),
    so the check reads what that environment's file lists."""
    config = validate_config(_config(speculators=True), PACKAGE_SCHEMA)
    check_config(config)  # installed in this process: fine without conda
    with pytest.raises(ConfigError) as caught:
        check_config(config, rule_env=REPO / "envs" / "torch.yaml")
    message = str(caught.value)
    assert "\n" not in message and "speculators, hs_connectors, datasets" in message
    assert "conda environment (torch.yaml)" in message
    listing = tmp_path / "speculators.yaml"
    listing.write_text(
        "dependencies:\n  - python=3.11\n  - conda-forge::datasets>=4\n  - pip\n"
        "  - pip:\n      - --no-deps\n      - Speculators==0.9.0\n      - hs_connectors==0.9.0\n"
    )
    check_config(config, rule_env=listing)


def test_packages_of_a_disabled_export_are_not_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    _hide(monkeypatch, "speculators", "hs_connectors", "datasets")
    check_config(validate_config(_config(specforge=True), PACKAGE_SCHEMA))


def test_the_speculators_export_job_names_what_to_install_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_process_job: None
) -> None:
    _hide(monkeypatch, "hs_connectors")
    monkeypatch.syspath_prepend(str(REPO / "src"))
    out, work, log = tmp_path / "out", tmp_path / "work", tmp_path / "export.log"
    job = SimpleNamespace(
        scriptdir=str(REPO / "scripts"),
        log=[str(log)],
        input=SimpleNamespace(
            manifests=[str(tmp_path / "A" / "manifest.json")],
            responses=[str(tmp_path / "A.jsonl")],
            draft_vocab=str(tmp_path / "draft_vocab.pt"),
            model=str(tmp_path / "model" / "config.json"),
        ),
        output=SimpleNamespace(directory=str(out)),
        params=SimpleNamespace(
            work_dir=str(work), datasets=["A"], dtype="bfloat16", seed=0, trust_remote_code=False
        ),
    )
    with pytest.raises(SystemExit):
        runpy.run_path(str(REPO / "scripts" / "export_speculators.py"), {"snakemake": job})
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    assert len(lines) == 1, lines  # one line, no traceback
    assert "hs_connectors" in lines[0] and "pip install --no-deps" in lines[0]
    assert "hs-connectors==0.9.0" in lines[0]
    assert not out.exists() and not work.exists()


def test_config_errors_are_user_errors() -> None:
    assert issubclass(ConfigError, UserError)
