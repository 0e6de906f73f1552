"""The report rule in the workflow, and `snakemake --report` packaging its pictures."""

from __future__ import annotations

import zipfile

import pytest
from PIL import Image
from support.workflow import Workflow

from eagle3data.monitor.report import FIGURES
from eagle3data.monitor.report_figures import DPI, figure_size

pytestmark = pytest.mark.e2e


def test_snakemake_report_packages_the_pictures(finished_run: Workflow) -> None:
    wf = finished_run  # the default target of two datasets (tests/conftest.py) ...
    assert set(wf.config["datasets"]) == {"A1", "B2"}
    for name in FIGURES:  # ... builds the pictures
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
