"""The status command's arguments: what-if limits as people type them, a config file
anywhere, and a hint when run in the wrong directory (the numbers of a what-if against
a real re-run: tests/workflow/test_midnight.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from support.workflow import REPO

from eagle3data.config import PACKAGE_SCHEMA, load_config
from eagle3data.monitor.status import main
from eagle3data.monitor.whatif import Change, apply_changes, parse_change
from eagle3data.units import human_count, parse_count


@pytest.mark.parametrize(
    ("text", "count"),
    [("7000", 7000), ("7_000", 7000), ("10M", 10_000_000), ("2.5k", 2500), ("1g", 10**9)],
)
def test_counts_as_people_type_them(text: str, count: int) -> None:
    assert parse_count(text) == count


@pytest.mark.parametrize("text", ["ten", "10x", "1.5", ""])
def test_what_is_not_a_count_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="count"):
        parse_count(text)


def test_counts_as_people_read_them() -> None:
    assert [human_count(n) for n in (999, 99_999, 100_000, 21_826_000, 999_600)] == [
        "999",
        "99999",
        "100k",
        "21.8M",
        "1M",
    ]


def test_a_change_names_a_dataset_and_a_limit() -> None:
    assert parse_change("B2=10M", "token_budget") == Change("B2", "token_budget", 10_000_000)
    assert parse_change("B3=none", "max_samples") == Change("B3", "max_samples", None)
    with pytest.raises(ValueError, match="DATASET=N"):
        parse_change("10M", "token_budget")


def _workflow(root: Path, **datasets: dict) -> Path:
    """A workflow directory: a Snakefile, its schema, a config (nothing run yet)."""
    (root / "config").mkdir(parents=True)
    (root / "Snakefile").write_text("")
    shutil.copy(REPO / "config" / "schema.yaml", root / "config" / "schema.yaml")
    config = {"model": {"path": "resources/model"}, "datasets": datasets}
    (root / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    return root


def test_changes_apply_to_a_copy_and_are_checked_like_the_file(tmp_path: Path) -> None:
    wf = _workflow(tmp_path / "wf", B2={"path": "x.jsonl", "max_samples": 7000})
    config = load_config(wf / "config" / "config.yaml")
    changed = apply_changes(config, [Change("B2", "token_budget", 900)], PACKAGE_SCHEMA)
    assert changed["datasets"]["B2"]["token_budget"] == 900
    assert config["datasets"]["B2"]["token_budget"] is None
    with pytest.raises(ValueError, match="no dataset 'B9'"):
        apply_changes(config, [Change("B9", "token_budget", 1)], PACKAGE_SCHEMA)
    with pytest.raises(Exception, match="minimum"):
        apply_changes(config, [Change("B2", "max_samples", -1)], PACKAGE_SCHEMA)


def test_a_config_outside_config_dir_and_a_what_if(tmp_path, capsys) -> None:
    wf = _workflow(tmp_path / "wf", B2={"path": "x.jsonl", "max_samples": 7000})
    elsewhere = tmp_path / "elsewhere" / "whatif.yaml"
    elsewhere.parent.mkdir()
    shutil.copy(wf / "config" / "config.yaml", elsewhere)
    assert main(["-d", str(wf), "--config", str(elsewhere), "--budget", "B2=10M"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("As if B2 token_budget 10M (now none) (nothing was changed):\n")
    assert "  B2 with token_budget 10M (now none):\n" in out
    # A workflow directory without its own schema: this checkout's is used.
    (wf / "config" / "schema.yaml").unlink()
    assert main(["-d", str(wf), "--config", str(elsewhere)]) == 0
    assert main(["-d", str(wf), "--budget", "B9=1"]) == 2
    assert "no dataset 'B9' in the config (there are B2)" in capsys.readouterr().err


def test_the_wrong_directory_gets_a_hint(tmp_path, capsys) -> None:
    wf = _workflow(tmp_path / "wf", B2={"path": "x.jsonl"})
    inside = wf / "results" / "responses"
    inside.mkdir(parents=True)
    assert main(["-d", str(inside)]) == 2
    err = capsys.readouterr().err
    assert f"no config/config.yaml in {inside.resolve()}: run eagle3data-status in the" in err
    assert err.rstrip().endswith(f"(this looks like one: -d {wf.resolve()})")
    assert main(["-d", str(wf), "--config", str(wf / "whatif.yaml")]) == 2
    assert f"{wf / 'whatif.yaml'}: no such file" in capsys.readouterr().err


def test_a_relative_directory_finds_the_model(tmp_path, capsys, monkeypatch) -> None:
    wf = _workflow(tmp_path / "wf", B2={"path": "x.jsonl", "token_budget": 100})
    model = wf / "resources" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"hidden_size": 64, "dtype": "bfloat16"}')
    monkeypatch.chdir(tmp_path)
    assert main(["-d", "wf", "--json"]) == 0
    # (3 + 1) x 64 x 2 bytes + int32 id + uint8 mask: the model was found under wf/.
    assert json.loads(capsys.readouterr().out)["bytes_per_token"] == 517
