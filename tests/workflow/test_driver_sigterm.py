"""SIGTERM must stop a real Snakemake driver, whatever its main thread holds at that
moment (see eagle3data.driver_signals; the mechanism alone: tests/unit/test_driver_signals.py)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.workflow import REPO

pytestmark = pytest.mark.e2e

SRC = str(REPO / "src")

SNAKEFILE = """
import sys
sys.path.insert(0, {src!r})
from eagle3data.driver_signals import relay_sigterm_off_main_thread


onstart:
    if {relay!r}:
        relay_sigterm_off_main_thread()


rule all:
    input:
        expand("out/{{i}}.txt", i=range(400)),


rule one:
    output:
        "out/{{i}}.txt",
    shell:
        "touch {{output}}"
"""


@pytest.mark.parametrize("relay", [False, True])
def test_sigterm_stops_a_busy_snakemake_driver(tmp_path: Path, relay: bool) -> None:
    """400 ready jobs keep the scheduler's main thread in its lock most of the time;
    unrelayed, Snakemake 9.27.1 hung on 15 of 15 SIGTERMs sent this way."""
    (tmp_path / "Snakefile").write_text(SNAKEFILE.format(src=SRC, relay=relay))
    outcomes = []
    for attempt in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-m", "snakemake", "--cores", "2", "--quiet"],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        out = tmp_path / "out"
        while proc.poll() is None and not (out.is_dir() and len(os.listdir(out)) > 5):
            time.sleep(0.05)
        time.sleep(0.5 * attempt)
        proc.send_signal(signal.SIGTERM)  # the driver only, as `kill PID` does
        try:
            # A stopping driver is gone in about a second here (the relayed runs); the
            # unrelayed deadlock is for ever, so 10 s tell the two apart.
            _, err = proc.communicate(timeout=60 if relay else 10)
            outcomes.append("stopped")
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            outcomes.append("hung")
        if relay:
            assert outcomes[-1] == "stopped", err
            assert proc.returncode == 1, err
            assert "Will exit after finishing currently running jobs" in err
        if outcomes[-1] == "hung":
            break  # one deadlock is proof enough
        shutil.rmtree(tmp_path / "out")
        shutil.rmtree(tmp_path / ".snakemake")
    if not relay:
        assert "hung" in outcomes, "Snakemake's own handler no longer deadlocks: drop the relay?"
