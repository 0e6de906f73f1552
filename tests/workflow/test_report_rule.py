"""The report rule in the workflow, and `snakemake --report` packaging its pictures."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
from PIL import Image
from support.workflow import alpaca_prompts, sharegpt_prompts, write_prompts

from eagle3data.monitor.report import DPI, FIGURES, figure_size

pytestmark = pytest.mark.e2e


def test_snakemake_report_packages_the_pictures(make_workflow, tmp_path: Path) -> None:
    a1 = write_prompts(tmp_path / "A1.jsonl", sharegpt_prompts(12))
    b2 = write_prompts(tmp_path / "B2.jsonl", alpaca_prompts(8))
    wf = make_workflow(
        {
            "A1": {"path": str(a1), "format": "sharegpt", "token_budget": 60},
            "B2": {"path": str(b2), "format": "alpaca", "max_samples": 4},
        }
    )
    wf.run()  # the default target builds the pictures
    for name in FIGURES:
        assert wf.path(f"results/report/{name}.png").stat().st_size > 0
    summary = wf.path("results/report/summary.html").read_text()
    assert '<table id="A1">' in summary and '<table id="B2">' in summary
    wf.run("--report", "report.zip")
    with zipfile.ZipFile(wf.path("report.zip")) as archive:
        names = archive.namelist()
        for name in FIGURES:
            packed = [n for n in names if n.endswith(f"/{name}.png")]
            assert packed, (name, names)
            with archive.open(packed[0]) as fh, Image.open(fh) as img:
                width, height = figure_size(name, 2)
                assert img.size == (round(width * DPI), round(height * DPI))
        assert any(n.endswith("/summary.html") for n in names)
    assert wf.plans_nothing()
