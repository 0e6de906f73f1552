"""The status command on real pipeline state: a run stopped mid-generation, then a
finished one (the journal summary behind it: tests/unit/test_progress.py)."""

from __future__ import annotations

import json
import signal
import time

import pytest
from support.workflow import alpaca_prompts, kill_group, sharegpt_prompts, write_prompts

from eagle3data.monitor.status import main
from eagle3data.units import human_bytes

pytestmark = pytest.mark.e2e


def test_status_mid_generation_and_after_the_run(make_workflow, tmp_path, capsys) -> None:
    a1 = write_prompts(tmp_path / "A1.jsonl", sharegpt_prompts(80))
    b2 = write_prompts(tmp_path / "B2.jsonl", alpaca_prompts(10))
    datasets = {
        "A1": {"path": str(a1), "format": "sharegpt", "token_budget": 400},
        "B2": {"path": str(b2), "format": "alpaca", "max_samples": 4},
    }
    wf = make_workflow(datasets, generation={"batch_size": 2})
    proc = wf.start("results/responses/A1.jsonl")
    deadline = time.monotonic() + 300
    while len(wf.journal_lines("A1")) < 8:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    kill_group(proc, signal.SIGTERM)

    journal = [json.loads(line) for line in wf.journal_lines("A1")]
    order = _order(wf, "A1")
    by_id = {r["id"]: r for r in journal}
    prefix = []
    for pid in order:  # the budget prefix decided so far, computed here independently
        if pid not in by_id:
            break
        prefix.append(by_id[pid])
    tokens = sum(r["usage"]["completion_tokens"] for r in prefix)

    assert main(["-d", str(wf.root), "--json"]) == 0
    status = {d["dataset"]: d for d in json.loads(capsys.readouterr().out)["datasets"]}
    a = status["A1"]
    assert a["stage"] == "generate"
    assert (a["prompts"], a["conversations_done"], a["completion_tokens"]) == (
        80,
        len(prefix),
        tokens,
    )
    generated = sum(r["usage"]["completion_tokens"] for r in journal)
    assert a["waste_tokens"] == generated - tokens
    assert a["token_budget"] == 400 and a["budget_used"] == pytest.approx(tokens / 400)
    # Stopped: no current rate or ETA; the projection goes at the last run's rate.
    assert (a["state"], a["tokens_per_s"], a["eta_s"]) == ("stopped", None, None)
    assert a["projection_rate"] > 0 and a["projection_rate_basis"] == "last run"
    assert a["projected_s"] == pytest.approx(a["tokens_to_generate"] / a["projection_rate"])
    assert a["conversations_planned"] > a["conversations_done"]
    assert a["estimate_basis"] == "extrapolated" and a["bytes_estimated"] > 0
    assert (a["shards_done"], a["shards_planned"], a["bytes_on_disk"]) == (0, None, 0)
    assert status["B2"]["stage"] == "prompts" and status["B2"]["prompts"] is None

    # The dry run says the same, in tokens still to generate and bytes to extract.
    dry = wf.run("-n", "results/responses/A1.jsonl")
    out = dry.stdout + dry.stderr
    assert (
        f"  A1: {tokens} completion tokens in {len(prefix)} conversations; "
        f"about {400 - tokens} completion tokens (~"
    ) in out
    more = a["conversations_planned"] - len(prefix)
    assert f"(~{more} conversations) to go (limits: 400 completion tokens)" in out
    hidden = f"  A1: {a['conversations_planned']} conversations, about "
    assert hidden in out and f"B = about {human_bytes(a['bytes_estimated'])} (extrapolated)" in out
    assert "  B2: nothing generated yet; up to 4 conversations" in out

    assert main(["-d", str(wf.root)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:4] == ["dataset", "state", "stage", "conversations"]
    assert table[1].split()[:5] == ["A1", "stopped", "generate",
                                    f"{len(prefix)}/{a['conversations_planned']}",
                                    f"{tokens}/400"]  # fmt: skip

    wf.run()
    assert main(["-d", str(wf.root), "--json"]) == 0
    status = {d["dataset"]: d for d in json.loads(capsys.readouterr().out)["datasets"]}
    for ds, st in status.items():
        stats = wf.stats(ds)
        manifest = json.loads(wf.path(f"results/hidden_states/{ds}/manifest.json").read_text())
        shards = sorted(wf.path(f"results/hidden_states/{ds}").glob("shard-*.h5"))
        assert (st["state"], st["stage"], st["stop_reason"]) == (
            "done",
            "done",
            stats["stop_reason"],
        )
        assert st["conversations_done"] == st["conversations_planned"] == stats["in_output"]
        assert st["completion_tokens"] == stats["completion_tokens"]
        assert st["waste_tokens"] == stats["waste_tokens"]
        assert st["shards_done"] == st["shards_planned"] == manifest["num_shards"] == len(shards)
        assert st["bytes_on_disk"] == sum(p.stat().st_size for p in shards)
        assert st["eta_s"] is None


def _order(wf, dataset: str) -> list[str]:
    import polars as pl

    df = pl.read_parquet(wf.path(f"results/prompts/{dataset}.parquet")).sort("index")
    return df["id"].to_list()
