"""The midnight question in miniature: a dataset launched with a sample cap and no token
budget, found running; is it running, where will it end, what if a budget is set now?

The run is frozen (SIGSTOP) while status looks, so that status and this test read the
same journal; every number status prints is recomputed here from the journal itself.
Then Ctrl-C, the what-if of a budget below what was generated, the budget set for real,
and the re-run: it must write exactly what the what-if said.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from support.workflow import Workflow, alpaca_prompts, kill_group, write_prompts

from eagle3data.config import load_config, schema_for
from eagle3data.layout import Results
from eagle3data.liveness import read_run
from eagle3data.monitor.projection import RATE_WINDOW_S
from eagle3data.monitor.snapshot import format_table, projection_lines
from eagle3data.monitor.status import main, snapshots
from eagle3data.units import duration, human_count

pytestmark = pytest.mark.e2e

PROMPTS, MAX_SAMPLES = 400, 300  # far more than the run gets through before it is stopped


def _journal(wf: Workflow) -> tuple[Path, list[dict[str, Any]]]:
    [path] = wf.path("results/.work/generate/B2").glob("*.jsonl")
    return path, [json.loads(line) for line in wf.journal_lines("B2")]


def _order(wf: Workflow) -> list[str]:
    table = pl.read_parquet(wf.path("results/prompts/B2.parquet")).sort("index")
    return table["id"].to_list()


def _prefix(order: list[str], records: list[dict[str, Any]], budget: int | None) -> list[dict]:
    """The budget prefix decided so far, computed here without the package."""
    by_id = {r["id"]: r for r in records}
    prefix: list[dict] = []
    tokens = 0
    for pid in order[:MAX_SAMPLES]:
        rec = by_id.get(pid)
        if rec is None:
            break
        n = rec["usage"]["completion_tokens"]
        if budget is not None and tokens + n > budget:
            break
        prefix.append(rec)
        tokens += n
        if budget is not None and tokens >= budget:
            break
    return prefix


def _cells(table: str) -> list[list[str]]:
    return [re.split(r"\s{2,}", line.strip()) for line in table.splitlines()]


def test_the_midnight_decision(make_workflow, tmp_path, capsys) -> None:
    b2 = write_prompts(tmp_path / "B2.jsonl", alpaca_prompts(PROMPTS))
    datasets = {"B2": {"path": str(b2), "format": "alpaca", "max_samples": MAX_SAMPLES}}
    wf = make_workflow(datasets, generation={"batch_size": 2, "progress_interval_s": 1})
    proc = wf.start("results/responses/B2.jsonl")
    deadline = time.monotonic() + 300
    while len(wf.journal_lines("B2")) < 10:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)

    # --- running: frozen while status and the test read the journal ------------------
    os.killpg(proc.pid, signal.SIGSTOP)
    try:
        config = load_config(wf.path("config/config.yaml"), schema_for(wf.root))
        now = time.time()
        [shot] = snapshots(config, Results(wf.root), now)
        journal, records = _journal(wf)
        run = read_run(journal)
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
    order = _order(wf)
    prefix = _prefix(order, records, None)
    tokens = sum(r["usage"]["completion_tokens"] for r in prefix)
    generated = sum(r["usage"]["completion_tokens"] for r in records)
    assert run is not None and run.ended_at is None and run.pid != os.getpid()
    start = max(now - RATE_WINDOW_S, run.started_at)
    rate = sum(r["usage"]["completion_tokens"] for r in records if r["finished_at"] > start) / (
        now - start
    )
    mean = tokens / len(prefix)  # no failures on this model: every record is in the mean
    more = min(PROMPTS - len(prefix), MAX_SAMPLES - len(prefix))
    projected, projected_convs = tokens + round(more * mean), len(prefix) + more

    st = shot.status
    assert (st.state, st.stage, st.stop_reason) == ("running", "generate", None)
    assert (st.conversations_done, st.completion_tokens, st.waste_tokens) == (
        len(prefix),
        tokens,
        generated - tokens,
    )
    assert st.tokens_per_s == pytest.approx(rate)
    assert (st.conversations_planned, st.projected_completion_tokens) == (
        projected_convs,
        projected,
    )
    assert st.projection_basis == "extrapolated" and st.projection_rate_basis == "this run"
    assert st.eta_s == pytest.approx((projected - tokens) / rate)
    [header, row] = _cells(format_table([st]))
    assert header[:8] == ["dataset", "state", "stage", "conversations",
                          "completion tokens / budget", "projected", "stop", "waste"]  # fmt: skip
    assert row[:10] == ["B2", "running", "generate", f"{len(prefix)}/{projected_convs}",
                        f"{tokens}/-", f"~{human_count(projected)}", "-",
                        str(generated - tokens), f"{rate:.0f}",
                        duration((projected - tokens) / rate)]  # fmt: skip
    [_, line] = projection_lines(config, [st])
    assert line.startswith(
        f"  B2: ~{human_count(projected_convs)} conversations, ~{human_count(projected)} "
        "completion tokens, ~"
    )
    assert f"~{human_count(projected - tokens)} completion tokens to go: " in line
    assert line.endswith(f"tok/s (this run) (limits: {MAX_SAMPLES} conversations; no token_budget)")

    # --- Ctrl-C: one line in the job's log, no traceback ------------------------------
    assert kill_group(proc, signal.SIGINT) != 0
    log = wf.path("logs/generate/B2.log").read_text()
    assert "Traceback" not in log and "KeyboardInterrupt" not in log
    _, records = _journal(wf)
    [stop_line] = [x for x in log.splitlines() if "stopped by SIGINT" in x]
    assert f"B2: stopped by SIGINT; {len(records)} responses finished in this run are kept" in (
        stop_line
    ) and stop_line.endswith("run the same command to resume")

    assert main(["-d", str(wf.root), "--json", "--plot", str(tmp_path / "plots")]) == 0
    [st] = json.loads(capsys.readouterr().out)["datasets"]
    assert (st["state"], st["tokens_per_s"], st["eta_s"]) == ("stopped", None, None)
    assert st["projection_rate_basis"] == "last run" and st["projection_rate"] > 0
    for name in ("budget_use", "throughput"):
        assert (tmp_path / "plots" / f"{name}.png").read_bytes()[:4] == b"\x89PNG"

    # --- what if a budget below what was generated were set now -----------------------
    prefix = _prefix(order, records, None)
    generated = sum(r["usage"]["completion_tokens"] for r in records)
    budget = sum(r["usage"]["completion_tokens"] for r in prefix[: len(prefix) // 2])
    kept = _prefix(order, records, budget)
    assert main(["-d", str(wf.root), "--budget", f"B2={budget}", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    [what_if], per_token = answer["datasets"], answer["bytes_per_token"]
    assert (what_if["conversations_done"], what_if["completion_tokens"]) == (len(kept), budget)
    assert (what_if["waste_tokens"], what_if["tokens_to_generate"]) == (generated - budget, 0)
    assert (what_if["stop_reason"], what_if["stage"]) == ("token_budget", "generate")
    assert main(["-d", str(wf.root), "--budget", f"B2={budget}"]) == 0
    text = capsys.readouterr().out
    assert (
        f"  B2 with token_budget {budget} (now none):\n"
        f"    output: {len(kept)} conversations, {budget} completion tokens "
        "(decided: it stops at token_budget)\n"
        f"    already generated: {generated} completion tokens, {generated - budget} of them "
        "wasted\n"
        "    generation: nothing to generate; the generate job only writes the output\n"
    ) in text

    # --- the budget set for real: the re-run writes what the what-if said -------------
    wf.config["datasets"]["B2"]["token_budget"] = budget
    wf.write_config()
    # The dry run agrees, and says that the generate job it lists generates nothing.
    dry = wf.run("-n", "results/responses/B2.jsonl")
    out = dry.stdout + dry.stderr
    assert (
        f"  B2: done: {budget} completion tokens in {len(kept)} conversations (limits: {budget} "
        f"completion tokens and {MAX_SAMPLES} conversations); waste {generated - budget} tokens; "
        "nothing to generate: its generate job only writes the output"
    ) in out
    tokens = what_if["bytes_estimated"] // per_token
    assert f"  B2: {len(kept)} conversations, about {tokens} tokens x {per_token} B = " in out
    wf.run("results/responses/B2.jsonl")
    stats = wf.stats("B2")
    assert (stats["in_output"], stats["completion_tokens"], stats["waste_tokens"]) == (
        what_if["conversations_done"],
        what_if["completion_tokens"],
        what_if["waste_tokens"],
    )
    assert (stats["stop_reason"], stats["records_generated_now"]) == ("token_budget", 0)
    assert main(["-d", str(wf.root), "--json"]) == 0
    [after] = json.loads(capsys.readouterr().out)["datasets"]
    same = ("conversations_planned", "projected_completion_tokens", "bytes_estimated")
    assert {k: after[k] for k in same} == {k: what_if[k] for k in same}
    assert (after["state"], after["stage"]) == ("stopped", "tokenize")
