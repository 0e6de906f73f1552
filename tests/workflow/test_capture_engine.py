"""One load of the target per capture phase, on the transformers backend (CPU).

A dataset of at least eight shards is captured, and the loads of the target are counted
from outside our code (``tests/support/instrument``: every ``HiddenStateExtractor`` built,
with its pid):

* the default, uninterrupted: one load for the phase;
* the same, killed with ``kill -9`` of the whole run once two shards are done, then the
  same command: one load before the kill and one for the six or more shards after it, the
  engines gone after each run (no process, no state directory), the shards byte-identical
  to the uninterrupted run;
* a single shard re-made by its file target: one load, the same bytes;
* two shards re-made with ``engine_lifetime: shard`` (how every shard job worked before):
  one load per shard, which shows the count sees each load.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support.workflow import REPO, Workflow, kill_group, sharegpt_prompts, write_prompts

pytestmark = [pytest.mark.e2e]

RESULTS = "results/hidden_states/A1"
MANIFEST = f"{RESULTS}/manifest.json"
INSTRUMENT = REPO / "tests" / "support" / "instrument"
STARTED = re.compile(r"started capture engine (\S+) \(pid (\d+)")
SERVES = re.compile(r"capture engine (\S+) \(pid \d+\) captures this shard: shard (\d+) of")


def loads(wf: Workflow) -> list[int]:
    path = wf.path("loads.jsonl")
    if not path.exists():
        return []
    return [json.loads(line)["pid"] for line in path.read_text().splitlines()]


def shard_logs(wf: Workflow) -> str:
    return "".join(p.read_text() for p in sorted(wf.path("logs/hidden_states/A1").glob("*.log")))


def shards(wf: Workflow) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(wf.path(RESULTS).glob("shard-*.h5"))}


def engine_processes(engine_root: Path) -> list[int]:
    """Live capture engines of this test (their command line names the module and their
    directory under ``engine_root``: a test beside this one, under pytest-xdist, may run its
    own)."""
    found = []
    root = str(engine_root).encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if b"eagle3data.hidden_states.capture_service" in cmdline and root in cmdline:
            found.append(int(proc.name))
    return found


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def nothing_left(engine_root: Path) -> None:
    wait_for(
        lambda: not engine_processes(engine_root),
        f"capture engines left: {engine_processes(engine_root)}",
    )
    wait_for(lambda: not any(engine_root.glob("*/*")), f"left in {engine_root}")


def test_the_target_loads_once_per_phase_and_a_killed_run_resumes_identical(
    make_workflow: Callable[..., Workflow], tmp_path: Path
) -> None:
    engine_root = tmp_path / "engines"
    prompts = write_prompts(tmp_path / "prompts.jsonl", sharegpt_prompts(24))
    wf = make_workflow(
        {"A1": {"path": str(prompts), "format": "sharegpt"}},
        hidden_states={"shard_bytes": 130_000},
    )
    wf.env.update(
        PYTHONPATH=os.pathsep.join([str(INSTRUMENT), os.environ.get("PYTHONPATH", "")]),
        EAGLE3DATA_LOAD_LOG=str(wf.path("loads.jsonl")),
        EAGLE3DATA_CAPTURE_ENGINE_DIR=str(engine_root),
    )
    wf.run("results/tokenized/A1.parquet")

    # The uninterrupted phase: one load for every shard.
    before = len(loads(wf))
    wf.run(MANIFEST)
    reference = shards(wf)
    assert len(reference) >= 8, "the dataset needs at least eight shards"
    assert len(loads(wf)) - before == 1, "one load for the phase"
    nothing_left(engine_root)

    # Killed in the middle of the capture, then the same command.
    for path in [*wf.path(RESULTS).glob("shard-*.h5"), *wf.path("logs/hidden_states/A1").iterdir()]:
        path.unlink()
    wf.path(MANIFEST).unlink()
    before = len(loads(wf))
    proc = wf.start(MANIFEST)
    deadline = time.monotonic() + 300
    # Two shards done: the run is in its third shard or between shard jobs (a shard's
    # write is too short for a poll to catch reliably on a fast machine).
    while len(shards(wf)) < 2:
        assert proc.poll() is None, "the capture ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert kill_group(proc, signal.SIGKILL) != 0
    nothing_left(engine_root)  # the engine saw its run die and stopped
    killed_at = len(shards(wf))
    assert len(loads(wf)) - before == 1, "one load before the kill"
    assert len(reference) - killed_at >= 6, "at least six shards left for one phase"

    for log in wf.path("logs/hidden_states/A1").glob("*.log"):
        log.unlink()
    wf.run("--unlock")
    before = len(loads(wf))
    wf.run(MANIFEST)
    assert len(loads(wf)) - before == 1, "one load for the rest of the phase"
    assert shards(wf) == reference, "the resumed run equals the uninterrupted one, byte for byte"
    assert not list(wf.path(RESULTS).glob(".shard-*.tmp"))
    logs = shard_logs(wf)
    started = STARTED.findall(logs)
    served = SERVES.findall(logs)
    assert len(started) == 1, logs[-3000:]
    assert {name for name, _ in served} == {started[0][0]}
    assert sorted(int(n) for _, n in served) == list(range(1, len(reference) - killed_at + 1))
    nothing_left(engine_root)

    # One shard re-made by its file target: one load, the same bytes.
    one = f"{RESULTS}/shard-00002.h5"
    wf.path(one).unlink()
    before = len(loads(wf))
    wf.run(one)
    assert len(loads(wf)) - before == 1
    assert shards(wf) == reference
    nothing_left(engine_root)

    # engine_lifetime: shard (how every shard job worked before; how to run, not what:
    # nothing else re-runs): a load per shard job, which shows the count sees each load, and
    # the same bytes as the phase's engine.
    wf.config["hidden_states"]["engine_lifetime"] = "shard"
    wf.write_config()
    remade = [f"{RESULTS}/shard-00000.h5", f"{RESULTS}/shard-00001.h5"]
    for target in remade:
        wf.path(target).unlink()
    before = len(loads(wf))
    wf.run(*remade)
    assert len(loads(wf)) - before == len(remade), "one load per shard job"
    assert shards(wf) == reference
    remade_logs = "".join(
        wf.path(f"logs/hidden_states/A1/{Path(target).stem}.log").read_text() for target in remade
    )
    assert not STARTED.search(remade_logs), "no capture engine for per-shard jobs"
    assert not engine_processes(engine_root)
