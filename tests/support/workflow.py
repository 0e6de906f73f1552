"""A throw-away copy of the workflow, driven the way a user drives it, and the prompt
files the workflow tests feed it."""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
WORKFLOW_SOURCES = (
    "Snakefile",
    "rules",
    "scripts",
    "envs",
    "config/schema.yaml",
    "profiles",
    "report",
    "src",
)


def write_prompts(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def sharegpt_prompts(n: int) -> list[dict[str, Any]]:
    """n ShareGPT records; every fifth is multi-turn, every seventh has a system prompt."""
    records = []
    for i in range(n):
        turns = []
        if i % 7 == 0:
            turns.append({"from": "system", "value": f"You are assistant number {i}."})
        turns.append({"from": "human", "value": f"Question {i}: what is {i} plus {i}?"})
        if i % 5 == 0:
            turns += [
                {"from": "gpt", "value": f"It is {2 * i}."},
                {"from": "human", "value": "Now say it in words."},
            ]
        records.append({"id": f"q{i:04d}", "conversations": turns})
    return records


def alpaca_prompts(n: int) -> list[dict[str, Any]]:
    return [
        {"instruction": f"Rewrite sentence {i} politely.", "input": "" if i % 2 else f"Do {i}!"}
        for i in range(n)
    ]


def two_datasets(base: Path) -> dict[str, dict[str, Any]]:
    """A1 (ShareGPT, 30 prompts, token_budget 100) and B2 (Alpaca, 20 prompts, max_samples 7),
    their prompt files written under ``base``: the run of ``finished_run`` (tests/conftest.py)."""
    a1 = write_prompts(base / "A1.jsonl", sharegpt_prompts(30))
    b2 = write_prompts(base / "B2.jsonl", alpaca_prompts(20))
    return {
        "A1": {"path": str(a1), "format": "sharegpt", "token_budget": 100},
        "B2": {"path": str(b2), "format": "alpaca", "max_samples": 7},
    }


class Workflow:
    """A copy of the workflow in a temporary directory, driven like a user would."""

    def __init__(self, root: Path, config: dict[str, Any]) -> None:
        self.root = root
        for name in WORKFLOW_SOURCES:
            src = REPO / name
            dst = root / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            if src.is_dir():
                shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(src, dst)
        self.config = config
        self.env: dict[str, str] = {}  # extra environment for every snakemake run
        self.write_config()

    def write_config(self) -> None:
        (self.root / "config" / "config.yaml").write_text(yaml.safe_dump(self.config))

    def copy(self, base: Path, name: str = "wf") -> Workflow:
        """This workflow as it stands (sources, config, results, Snakemake's records, the
        files' times), copied to ``base / name``: one finished run serves tests that change
        it. The prompt files and the model stay where the config names them."""
        root = base / name
        shutil.copytree(self.root, root, symlinks=True)
        twin = Workflow.__new__(Workflow)
        twin.root, twin.config, twin.env = root, copy.deepcopy(self.config), dict(self.env)
        return twin

    def command(self, *args: str) -> list[str]:
        # One thread per model job lets two jobs share the 2-core test machine.
        threads = ("generate=1", "hidden_states=1", "demo_model=1")
        return [sys.executable, "-m", "snakemake", "--cores", "2", *args, "--set-threads", *threads]

    def run(
        self, *args: str, check: bool = True, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            self.command(*args),
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=_env(self.env),
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"snakemake {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                f"{proc.stderr[-8000:]}"
            )
        return proc

    def start(self, *args: str) -> subprocess.Popen[str]:
        """Start snakemake in its own process group (like a shell job or a batch job)."""
        return subprocess.Popen(
            self.command(*args),
            cwd=self.root,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
            env=_env(self.env),
            start_new_session=True,
        )

    def kill_and_resume(self, target: str, sig: signal.Signals, after_records: int) -> list[str]:
        """Start ``target``, kill the process group once the generation journal has
        ``after_records`` lines, check nothing partial was declared, then re-run the
        same command (after --unlock for SIGKILL, as docs/how-to/resume.md says). Returns the
        journal lines present at the kill."""
        dataset = Path(target).stem
        proc = self.start(target)
        deadline = time.monotonic() + 300
        while len(self.journal_lines(dataset)) < after_records:
            assert proc.poll() is None, "generation finished before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert kill_group(proc, sig) != 0
        assert not self.path(target).exists(), "no partial declared output"
        partial = self.journal_lines(dataset)
        if sig == signal.SIGKILL:
            self.run("--unlock")
        self.run(target)
        return partial

    def assert_resumed(self, dataset: str, partial: list[str], reference: Workflow) -> None:
        """Journal kept and extended without duplicates; output equals ``reference``'s."""
        journal = self.journal_lines(dataset)
        ids = [json.loads(line)["id"] for line in journal]
        assert len(ids) == len(set(ids)), "no response journaled twice"
        assert journal[: len(partial)] == partial
        assert self.stats(dataset)["records_resumed"] >= len(partial)
        output = f"results/responses/{dataset}.jsonl"
        assert self.path(output).read_bytes() == reference.path(output).read_bytes()

    def plans_nothing(self, *targets: str) -> bool:
        proc = self.run("-n", *targets)
        return "Nothing to be done" in proc.stdout + proc.stderr

    def path(self, relative: str) -> Path:
        return self.root / relative

    def responses(self, dataset: str) -> list[dict[str, Any]]:
        text = self.path(f"results/responses/{dataset}.jsonl").read_text(encoding="utf-8")
        return [json.loads(line) for line in text.splitlines()]

    def stats(self, dataset: str) -> dict[str, Any]:
        return json.loads(self.path(f"results/responses/{dataset}.stats.json").read_text())

    def journal_lines(self, dataset: str) -> list[str]:
        """The generation journal's outcome records (ok or failed), in order."""
        return [line for line in self._journal(dataset) if '"status":"abandoned"' not in line]

    def abandoned_lines(self, dataset: str) -> list[str]:
        """The journal's records of conversations cancelled in flight (not outcomes)."""
        return [line for line in self._journal(dataset) if '"status":"abandoned"' in line]

    def _journal(self, dataset: str) -> list[str]:
        files = list(self.path(f"results/.work/generate/{dataset}").glob("*.jsonl"))
        assert len(files) <= 1, files
        return files[0].read_text(encoding="utf-8").splitlines() if files else []


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


def kill_group(proc: subprocess.Popen[str], sig: signal.Signals) -> int:
    os.killpg(proc.pid, sig)
    try:
        return proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def new_workflow(
    base: Path,
    model_dir: Path,
    datasets: dict[str, dict[str, Any]],
    name: str = "wf",
    **overrides: Any,
) -> Workflow:
    """A workflow copy under ``base`` using ``model_dir``, with small test settings."""
    root = base / name
    root.mkdir()
    config: dict[str, Any] = {
        "model": {"path": str(model_dir)},
        "generation": {
            "batch_size": 4,
            "progress_interval_s": 0,
            "sampling": {"temperature": 0.0, "max_tokens": 8},
        },
        "hidden_states": {"max_seq_len": 256, "shard_bytes": 160_000, "batch_tokens": 512},
        # Off unless a test turns it on: a random tiny model's logits are near-uniform (its
        # greedy picks are near-ties that another batch shape flips) and a scripted server
        # is not the target, so "the target agrees with its tokens" does not hold there.
        "validate": {"agreement": {"enabled": False}},
        "datasets": datasets,
    }
    for section, values in overrides.items():
        config.setdefault(section, {}).update(values)
    return Workflow(root, config)


@dataclass
class ShardStates:
    """What a dataset's shards hold: each file's bytes, each sample's states (float32) and
    ids, the aux layer ids and the final state they record."""

    shards: dict[str, bytes]
    states: dict[str, tuple[Any, Any, list[int]]]  # id -> (aux [T, 3H], last [T, H], input ids)
    layers: list[int]
    final_state: str


def read_shard_states(directory: Path) -> ShardStates:
    """Every ``shard-*.h5`` under ``directory`` (results/hidden_states/{dataset})."""
    import torch

    from eagle3data.shards import open_shard

    read = ShardStates({}, {}, [], "")
    for path in sorted(directory.glob("shard-*.h5")):
        read.shards[path.name] = path.read_bytes()
        with open_shard(path) as shard:
            read.layers = [int(k) for k in shard.attrs["aux_layer_ids"]]
            read.final_state = shard.attrs["final_state"]
            for i in range(shard.num_samples):
                s = shard.sample(i)
                read.states[s["id"]] = (
                    torch.from_numpy(s["aux_hidden_states"]).float(),
                    torch.from_numpy(s["last_hidden_states"]).float(),
                    [int(t) for t in s["input_ids"]],
                )
    return read
