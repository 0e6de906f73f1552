"""Chaos: kill the whole workflow at random moments with SIGINT, SIGTERM or SIGKILL,
re-run the README's command until it finishes, and compare every file with an
uninterrupted run's. Seeded, so a failure can be replayed (CHAOS_SEED=...).

Each kill waits until a job of a chosen stage is running (read from /proc), then a
random time more, so every stage is hit: generate, tokenize, hidden-state shards and
validate. Engine work is counted across the kills: the in-process engine through
``tests/support/instrument/sitecustomize.py``, the HTTP backend by the fake server itself.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from support.workflow import REPO, Workflow, alpaca_prompts, sharegpt_prompts, write_prompts

from eagle3data.shards import open_shard, validate_shard

pytestmark = [pytest.mark.e2e, pytest.mark.chaos]

SEED = int(os.environ.get("CHAOS_SEED", "20261130"))
SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGKILL]
INSTRUMENT = REPO / "tests" / "support" / "instrument"
STAGE_OF_SCRIPT = {
    "prepare_prompts.py": "prompts",
    "generate.py": "generate",
    "tokenize.py": "tokenize",
    "plan_shards.py": "plan_shards",
    "extract_hidden_states.py": "hidden_states",
    "validate_shards.py": "validate",
}
PIPELINE = ["prompts", "generate", "tokenize", "plan_shards", "hidden_states", "validate"]
# (stage to wait for, extra seconds to wait: low, high) for each kill, in pipeline order.
# Seconds each in-process engine call of the chaos run waits first (the instrument's).
ENGINE_CALL_DELAY_S = 0.4
# Two kills per stage (each kill is a restart of Snakemake and its jobs, ~20 s on the 2-core CI
# machine): a second chance for a stage that ended before the first kill landed.
KILL_PLAN = (
    [("generate", 1.0, 5.0)] * 2
    + [("tokenize", 0.0, 0.5)] * 2
    + [("hidden_states", 0.5, 3.0)] * 2
    + [("validate", 0.0, 0.2)] * 2
)


def running_stages(pgid: int) -> set[str]:
    """Stages whose job scripts run in process group ``pgid`` (Snakemake runs
    ``script:`` rules as ``python .snakemake/scripts/tmpXXXX.<script>.py``)."""
    stages = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # exited while we looked
        if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
            continue
        for arg in cmdline:
            name = Path(arg.decode(errors="replace")).name
            if name.startswith("tmp") and "." in name:
                stage = STAGE_OF_SCRIPT.get(name.split(".", 1)[1])
                if stage:
                    stages.add(stage)
    return stages


GRACE_S = 60.0  # how long a signalled run may take to stop before it counts as hung


def group_pids(pgid: int) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                    pids.append(int(proc.name))
            except (OSError, ValueError, IndexError):
                continue  # exited while we looked
    return pids


def _stacks_of(pids: list[int], stack_dir: Path) -> str:
    """Ask each process to write its Python stacks (tests/support/instrument/sitecustomize.py)
    and return them with each process's command line."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
    time.sleep(2.0)
    report = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            cmdline = "(gone)"
        dump = stack_dir / f"{pid}.txt"
        report.append(f"--- pid {pid}: {cmdline}\n{dump.read_text() if dump.exists() else ''}")
    return "\n".join(report)


def stop_group(proc: Any, sig: signal.Signals, stack_dir: Path) -> tuple[float, str | None]:
    """Signal the run's process group and wait until *every* process of it is gone (a
    job may outlive Snakemake while it stops). Returns the seconds that took, and for
    a run still there GRACE_S later (hung) the stacks of its processes, after which
    it is SIGKILLed."""
    os.killpg(proc.pid, sig)
    start = time.monotonic()
    while (proc.poll() is None or group_pids(proc.pid)) and time.monotonic() < start + GRACE_S:
        time.sleep(0.05)
    seconds = round(time.monotonic() - start, 1)
    stuck = group_pids(proc.pid)
    if not stuck and proc.poll() is not None:
        return seconds, None
    stacks = _stacks_of(stuck, stack_dir)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    while group_pids(proc.pid):
        time.sleep(0.05)
    return seconds, stacks


def wait_for_stage(proc: Any, stage: str, timeout: float = 300) -> bool:
    """Wait until a job of ``stage`` or a later stage runs; False if the run ended."""
    wanted = set(PIPELINE[PIPELINE.index(stage) :])
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if running_stages(proc.pid) & wanted:
            return True
        assert time.monotonic() < deadline, f"no {stage} job started in {timeout} s"
        time.sleep(0.02)
    return False


def first_user_text(messages: list[dict[str, Any]]) -> str:
    """What identifies a prompt in engine calls and journal records alike."""
    return next(m["content"] for m in messages if m["role"] == "user")


def durable_journal_keys(wf: Workflow, datasets: Any) -> set[str]:
    """Prompts whose journal record is complete (newline-terminated) on disk."""
    keys = set()
    for ds in datasets:
        for path in wf.path(f"results/.work/generate/{ds}").glob("*.jsonl"):
            *complete, _tail = path.read_bytes().split(b"\n")
            records = [json.loads(line) for line in complete]
            # Abandoned records (cancelled in flight) note waste; they decide nothing.
            keys |= {first_user_text(r["messages"]) for r in records if "messages" in r}
    return keys


def tear_last_record(wf: Workflow, datasets: Any) -> str | None:
    """Leave half a record at the end of a journal still being written, as a power loss
    during an append would; return its dataset. Records already there were fsynced
    and survive a power loss, so they stay whole."""
    for ds in datasets:
        if wf.path(f"results/responses/{ds}.jsonl").exists():
            continue  # that generate job is finished: nothing appends to its journal
        for path in wf.path(f"results/.work/generate/{ds}").glob("*.jsonl"):
            records = path.read_bytes().splitlines(keepends=True)
            if records:
                with path.open("ab") as fh:
                    fh.write(records[-1][: len(records[-1]) // 2])
                return ds
    return None


def call_log(path: Path) -> list[list[dict[str, Any]]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def _datasets(tmp_path: Path) -> dict[str, dict]:
    a1 = write_prompts(tmp_path / "A1.jsonl", sharegpt_prompts(40))
    b2 = write_prompts(tmp_path / "B2.jsonl", alpaca_prompts(30))
    return {
        "A1": {"path": str(a1), "format": "sharegpt", "token_budget": 160},
        "B2": {"path": str(b2), "format": "alpaca", "max_samples": 12},
    }


def _torn_logged(wf: Workflow, dataset: str | None) -> bool:
    """Whether the dataset's generate log says it dropped a torn journal record."""
    if dataset is None:
        return False
    log = wf.path(f"logs/generate/{dataset}.log")
    return log.exists() and "dropped a torn last record" in log.read_text()


def _shard_contents(wf: Workflow, ds: str) -> list[tuple]:
    out = []
    for path in sorted(wf.path(f"results/hidden_states/{ds}").glob("shard-*.h5")):
        assert validate_shard(path).ok, path
        with open_shard(path) as shard:
            out.append(
                (
                    path.name,
                    shard.sample_ids,
                    shard.input_ids.tolist(),
                    shard.loss_mask.tolist(),
                    shard.aux_hidden_states().tobytes(),
                    shard.last_hidden_states().tobytes(),
                )
            )
    return out


def _instrument(wf: Workflow) -> Path:
    """Load tests/support/instrument/sitecustomize.py in every Python process of ``wf``'s runs,
    with stack dumps on SIGUSR1 into the returned folder."""
    stacks = wf.root / "stacks"
    stacks.mkdir(exist_ok=True)
    wf.env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(INSTRUMENT), os.environ.get("PYTHONPATH")])),
        EAGLE3DATA_STACK_DIR=str(stacks),
    )
    return stacks


def _counted(wf: Workflow, name: str) -> Path:
    """Also count the in-process engine's calls, into the returned file."""
    _instrument(wf)
    log = wf.root / f"{name}.calls.jsonl"
    wf.env["EAGLE3DATA_CALL_LOG"] = str(log)
    return log


def _assert_same_results(wf: Workflow, reference: Workflow, datasets: Any, kills: Any) -> None:
    for ds in datasets:
        for rel in (f"results/responses/{ds}.jsonl", f"results/prompts/{ds}.skipped.jsonl"):
            assert wf.path(rel).read_bytes() == reference.path(rel).read_bytes(), (rel, kills)
        ids = [json.loads(line)["id"] for line in wf.journal_lines(ds)]
        assert len(ids) == len(set(ids)), "no prompt journaled twice"


def _assert_nothing_redone(calls: list[str], snapshots: list[tuple[int, set[str]]]) -> None:
    """After each kill, no prompt whose record was durable at the kill is asked again."""
    for k, (seen, durable) in enumerate(snapshots):
        redone = sorted(set(calls[seen:]) & durable)
        assert not redone, f"kill {k}: journaled prompts generated again: {redone[:3]}"


def test_random_kills_at_every_stage_change_nothing(make_workflow, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    datasets = _datasets(tmp_path)
    reference = make_workflow(datasets, name="reference", generation={"batch_size": 2})
    reference_calls = _counted(reference, "reference")
    reference.run()

    wf = make_workflow(datasets, name="chaos", generation={"batch_size": 2})
    calls_path = _counted(wf, "chaos")
    # Generation must outlast the waits of KILL_PLAN: on a fast idle machine the tiny model
    # ended it before the first kill, which then hit tokenize (seen on this workplace's
    # Intel machine).
    wf.env["EAGLE3DATA_ENGINE_CALL_DELAY_S"] = str(ENGINE_CALL_DELAY_S)
    signals = rng.sample(SIGNALS * 3, len(KILL_PLAN))  # each signal at least twice
    kills, snapshots, hangs, torn, torn_logged = [], [], [], None, False
    for sig, (stage, low, high) in zip(signals, KILL_PLAN, strict=True):
        proc = wf.start()
        if not wait_for_stage(proc, stage):
            break  # the run finished: nothing left to interrupt
        time.sleep(rng.uniform(low, high))
        hit = running_stages(proc.pid)
        if proc.poll() is not None:
            break
        seconds, hung = stop_group(proc, sig, wf.root / "stacks")
        kills.append((sig.name, stage, sorted(hit), seconds))
        if hung:
            hangs.append(f"{sig.name} while {sorted(hit)} ran:\n{hung}")
        if sig == signal.SIGKILL or hung:
            if sig == signal.SIGKILL and "generate" in hit and not torn:
                torn = tear_last_record(wf, datasets)  # power loss mid-append
            wf.run("--unlock")  # docs/how-to/resume.md: after kill -9, unlock, then rerun
        snapshots.append((len(call_log(calls_path)), durable_journal_keys(wf, datasets)))
        # Snakemake empties a job's log when the job starts again: look after each kill.
        torn_logged = torn_logged or _torn_logged(wf, torn)
    wf.run()
    print(f"seed {SEED}: kills (signal, waited for, stages running, seconds to stop): {kills}")
    assert not hangs, f"seed {SEED}: runs still there {GRACE_S} s after a signal:\n" + "\n".join(
        hangs
    )

    hit_stages = {s for kill in kills for s in kill[2]}
    assert {"generate", "tokenize", "hidden_states", "validate"} <= hit_stages, (SEED, kills)
    assert {k[0] for k in kills} == {s.name for s in SIGNALS}, (SEED, kills)
    assert wf.plans_nothing()

    _assert_same_results(wf, reference, datasets, kills)
    for ds in datasets:
        ours = pl.read_parquet(wf.path(f"results/tokenized/{ds}.parquet"))
        theirs = pl.read_parquet(reference.path(f"results/tokenized/{ds}.parquet"))
        assert ours.equals(theirs), (ds, kills)
        assert _shard_contents(wf, ds) == _shard_contents(reference, ds), (ds, kills)
        manifest = json.loads(wf.path(f"results/hidden_states/{ds}/manifest.json").read_text())
        want = json.loads(reference.path(f"results/hidden_states/{ds}/manifest.json").read_text())
        assert [s["samples"] for s in manifest["shards"]] == [s["samples"] for s in want["shards"]]
    leftovers = [p for p in wf.path("results").rglob("*.tmp")]
    assert not leftovers, f"temporaries of killed writers left behind: {leftovers}"
    if torn:
        assert torn_logged or _torn_logged(wf, torn), (SEED, kills)

    # Engine work: an uninterrupted run asks each turn once; the chaos run never asks a
    # journaled prompt again and repeats at most the batch in flight at each kill.
    ref = [json.dumps(c, sort_keys=True) for c in call_log(reference_calls)]
    assert ref and len(ref) == len(set(ref))
    ours_calls = [json.dumps(c, sort_keys=True) for c in call_log(calls_path)]
    _assert_nothing_redone([first_user_text(json.loads(c)) for c in ours_calls], snapshots)
    repeats = sum(n - 1 for n in collections.Counter(ours_calls).values())
    turns_per_batch = 2 * 2  # batch_size 2, at most two user turns per prompt
    assert repeats <= len(kills) * turns_per_batch, (repeats, kills)


def test_random_kills_of_http_generation_change_nothing(make_workflow, tmp_path: Path) -> None:
    from support.fake_openai import FakeOpenAIServer

    rng = random.Random(SEED + 1)
    datasets = _datasets(tmp_path)
    write_prompts(Path(datasets["A1"]["path"]), sharegpt_prompts(120))
    datasets["A1"]["token_budget"] = 1200
    datasets["B2"]["max_samples"] = 24
    targets = [f"results/responses/{ds}.jsonl" for ds in datasets]
    concurrency = 8
    # 4 slots at 20 tokens/s and ~20 tokens per answer: ~4 answers/s, so the ~84
    # answers take ~20 s: long enough for every kill to land during generation.
    with FakeOpenAIServer(model="tiny", slots=4, tokens_per_s=20, mean_tokens=20) as server:
        http = {
            "generation": {
                "backend": "openai",
                "endpoints": [server.url],
                "served_model": "tiny",
                "concurrency": concurrency,
            }
        }
        reference = make_workflow(datasets, name="reference", **http)
        reference.run(*targets)
        assert all(n == 1 for n in server.completed_per_conversation().values())
        server.reset()

        wf = make_workflow(datasets, name="chaos", **http)
        stacks = _instrument(wf)
        signals = rng.sample(SIGNALS * 2, 6)  # each signal twice
        kills, snapshots, hangs = [], [], []
        for sig in signals:
            proc = wf.start(*targets)
            if not wait_for_stage(proc, "generate"):
                break
            time.sleep(rng.uniform(0.5, 3.0))
            if proc.poll() is not None:
                break
            seconds, hung = stop_group(proc, sig, stacks)
            kills.append((sig.name, seconds))
            if hung:
                hangs.append(f"{sig.name}:\n{hung}")
            if sig == signal.SIGKILL or hung:
                wf.run("--unlock")
            snapshots.append((len(server.requests), durable_journal_keys(wf, datasets)))
        wf.run(*targets)
        print(f"seed {SEED + 1}: kills (signal, seconds to stop): {kills}")
        assert not hangs, f"seed {SEED + 1}: runs still there {GRACE_S} s after a signal:\n" + (
            "\n".join(hangs)
        )
        requests = [first_user_text(body["messages"]) for body in server.requests]
        completed = server.completed_per_conversation()

    assert len(kills) >= 5, (SEED + 1, kills)
    assert {k[0] for k in kills} == {s.name for s in SIGNALS}, (SEED + 1, kills)
    assert wf.plans_nothing(*targets)
    _assert_same_results(wf, reference, datasets, kills)
    _assert_nothing_redone(requests, snapshots)
    # Only requests in flight at a kill (at most `concurrency` each) are answered again.
    repeats = sum(n - 1 for n in completed.values())
    assert repeats <= len(kills) * concurrency, (repeats, kills)
