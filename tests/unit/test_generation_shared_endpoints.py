"""Datasets generate at once against one server, sharing its one ``concurrency``.

The generate jobs of two datasets run as two processes (as Snakemake runs them) against
one fake server, each through the generate stage itself; the server counts the requests
it holds at once and notes which dataset each one came from.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from support.fake_openai import FakeOpenAIServer
from support.workflow import REPO

from eagle3data.generation.engines import endpoint_slots
from eagle3data.generation.engines.endpoint_slots import EndpointSlots, endpoint_key, slot_root
from eagle3data.generation.settings import GenerationSettings
from eagle3data.generation.stage import generate
from eagle3data.layout import Results
from eagle3data.prompts.sources import Conversation, prompt_hash
from eagle3data.prompts.table import write_prompts

URL = "http://127.0.0.1:9/v1"
CONCURRENCY = 4
SAMPLING = {
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": -1,
    "max_tokens": 64,
    "repetition_penalty": 1.0,
    "stop": [],
}


# --------------------------------------------------------------------------- the slots alone


@pytest.fixture
def no_lag(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each job sees the others' state at once (not up to SLOT_POLL_S late)."""
    monkeypatch.setattr(endpoint_slots, "SLOT_POLL_S", 0.0)


def test_every_job_of_an_endpoint_draws_from_its_one_set_of_slots(
    tmp_path: Path, no_lag: None
) -> None:
    a, b = EndpointSlots(tmp_path, URL, 3), EndpointSlots(tmp_path, URL + "/", 3)
    other = EndpointSlots(tmp_path, "http://127.0.0.1:10/v1", 3)
    try:
        taken = [a.take(), a.take(), a.take()]
        assert sorted(taken) == [0, 1, 2]  # type: ignore[type-var]
        assert a.take() is None and b.take() is None, "three in flight at most, all jobs together"
        assert other.take() is not None, "another endpoint has slots of its own"
        a.give(taken[1])  # type: ignore[arg-type]
        assert b.take() == taken[1]
        assert a.take() is None
        assert (a.directory / "endpoint.txt").read_text() == URL + "\n"
        assert a.directory.name == endpoint_key(URL)
    finally:
        for slots in (a, b, other):
            slots.close()
    fresh = EndpointSlots(tmp_path, URL, 3)
    assert [fresh.take() is not None for _ in range(3)] == [True] * 3, "closing frees all"
    fresh.close()


def test_a_job_holding_its_share_leaves_free_slots_to_one_that_wants(
    tmp_path: Path, no_lag: None
) -> None:
    greedy, late = EndpointSlots(tmp_path, URL, 4), EndpointSlots(tmp_path, URL, 4)
    try:
        held = [greedy.take() for _ in range(4)]
        assert late.share() == greedy.share() == 2
        late.want(True)  # holds none of its two
        greedy.give(held.pop())  # type: ignore[arg-type]
        assert greedy.take() is None, "it holds its share and the other job wants"
        assert late.take() is not None
        greedy.give(held.pop())  # type: ignore[arg-type]
        assert late.take() is not None
        late.want(True)  # it holds its share now: it no longer asks for more
        assert greedy.take() is None, "nothing is free"
        late.want(False)
        late.close()
        assert [greedy.take() is not None for _ in range(2)] == [True, True], "alone again"
    finally:
        greedy.close()
        late.close()


def test_slot_root_is_under_the_work_folder_unless_the_environment_moves_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(endpoint_slots.SLOT_DIR_ENV, raising=False)
    assert slot_root(Results(tmp_path)) == tmp_path / "results/.work/endpoint-slots"
    monkeypatch.setenv(endpoint_slots.SLOT_DIR_ENV, str(tmp_path / "elsewhere"))
    assert slot_root(Results(tmp_path)) == tmp_path / "elsewhere"


def test_the_open_file_limit_is_raised_for_a_socket_and_a_slot_per_request(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import resource

    limits = {"now": (1024, 4096)}
    monkeypatch.setattr(resource, "getrlimit", lambda _: limits["now"])
    monkeypatch.setattr(resource, "setrlimit", lambda _, value: limits.update(now=value))
    endpoint_slots.allow_open_files(256)  # 768 needed
    assert limits["now"] == (1024, 4096)
    endpoint_slots.allow_open_files(1000)
    assert limits["now"] == (2256, 4096)
    endpoint_slots.allow_open_files(4 * 512)
    assert limits["now"] == (4096, 4096)
    assert "raise `ulimit -n` or lower generation.concurrency" in caplog.text


HOLDER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from eagle3data.generation.engines.endpoint_slots import EndpointSlots
    slots = EndpointSlots(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
    while slots.take() is not None:
        pass
    print(slots.held, flush=True)
    sys.stdin.readline()
    """
)


def test_a_job_killed_holding_slots_leaks_none(tmp_path: Path, no_lag: None) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path), URL, "3"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "3"
        mine = EndpointSlots(tmp_path, URL, 3)
        assert mine.take() is None
        assert len(list((mine.directory / "jobs").glob("*.job"))) == 2
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        assert [mine.take() is not None for _ in range(3)] == [True] * 3
        mine.close()
        assert list((mine.directory / "jobs").iterdir()) == [], "the dead job's files went too"
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


# --------------------------------------------------------------------------- two datasets' jobs


def write_dataset(root: Path, dataset: str, n: int) -> dict[str, str]:
    """Prompts of ``dataset`` (its name in every user turn: the server tells them apart by
    it; every fourth is two turns), as the prompts stage writes them; the job's paths."""
    conversations = []
    for i in range(n):
        messages = [{"role": "user", "content": f"{dataset} question {i}"}]
        if i % 4 == 0:
            messages += [
                {"role": "assistant", "content": "source answer"},
                {"role": "user", "content": f"{dataset} follow-up {i}"},
            ]
        conversations.append(
            Conversation(f"{dataset}-{i:03d}", messages, None, prompt_hash(messages))
        )
    paths = {
        "prompts_path": root / f"results/prompts/{dataset}.parquet",
        "skipped_path": root / f"results/prompts/{dataset}.skipped.jsonl",
        "out_responses": root / f"results/responses/{dataset}.jsonl",
        "out_stats": root / f"results/responses/{dataset}.stats.json",
        "out_errors": root / f"results/responses/{dataset}.errors.jsonl",
        "out_records": root / f"results/responses/{dataset}.records.parquet",
    }
    for path in paths.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    write_prompts(paths["prompts_path"], conversations)
    paths["skipped_path"].write_text("")
    return {k: str(v) for k, v in paths.items()}


def job_arguments(root: Path, model: Path, url: str, dataset: str) -> dict[str, Any]:
    """What the generate rule passes the stage for ``dataset`` (no budget: every prompt),
    as JSON (the job below runs in a process of its own): :func:`stage_arguments` makes
    the stage's arguments of it."""
    settings = {
        "model": "fake-model",
        "model_path": str(model),
        "dtype": "auto",
        "chat_template_kwargs": {},
        "backend": "openai",
        "seed": 0,
        "sampling": SAMPLING,
        "served_model": "fake-model",
        "extra_body": {},
    }
    execution = {
        "device": "auto",
        "endpoints": [url],
        "api_key_env": None,
        "concurrency": CONCURRENCY,
        "request_timeout_s": 30,
        "max_retries": 2,
        "max_consecutive_failures": 20,
        "max_error_rate": 0.5,
        "progress_interval_s": 0,
        "return_token_ids": True,
        "trust_remote_code": False,
    }
    return {
        "dataset": dataset,
        "settings": settings,
        "execution": execution,
        "token_budget": None,
        "max_samples": None,
    }


def stage_arguments(arguments: dict[str, Any]) -> dict[str, Any]:
    """``arguments`` (:func:`job_arguments`) with the settings parsed as the script does."""
    rest = {k: v for k, v in arguments.items() if k not in ("settings", "execution")}
    settings = GenerationSettings.parse(arguments["settings"], arguments["execution"])
    return {"settings": settings, **rest}


# One generate job in a process of its own, as Snakemake runs it: it imports everything,
# waits for the go file (so that the jobs start together, whatever their import times),
# then runs the stage in the workflow directory argv[1] with the arguments in argv[2].
JOB = textwrap.dedent(
    """
    import json, logging, os, sys, time
    from pathlib import Path
    from eagle3data.generation.settings import GenerationSettings
    from eagle3data.generation.stage import generate
    from eagle3data.layout import Results
    root, arguments, go = Path(sys.argv[1]), json.loads(sys.argv[2]), Path(sys.argv[3])
    os.chdir(root)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    while not go.exists():
        time.sleep(0.01)
    settings = GenerationSettings.parse(arguments.pop("settings"), arguments.pop("execution"))
    generate(results=Results(root), settings=settings, **arguments)
    """
)


class Datasets:
    """Two datasets' prompts and job arguments in one workflow directory."""

    def __init__(self, root: Path, url: str, n: int = 24) -> None:
        self.root = root
        model = root / "model"
        model.mkdir(parents=True)
        (model / "config.json").write_text("{}")
        self.arguments: dict[str, dict[str, Any]] = {}
        for dataset in ("A1", "B2"):
            self.arguments[dataset] = {
                **job_arguments(root, model, url, dataset),
                **write_dataset(root, dataset, n),
            }

    def start(self, dataset: str, go: Path) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [
                sys.executable,
                "-c",
                JOB,
                str(self.root),
                json.dumps(self.arguments[dataset]),
                str(go),
            ],
            cwd=self.root,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        )

    def run_in_process(self, dataset: str) -> None:
        generate(results=Results(self.root), **stage_arguments(self.arguments[dataset]))

    def output(self, dataset: str) -> bytes:
        return Path(self.arguments[dataset]["out_responses"]).read_bytes()

    def journal_lines(self, dataset: str) -> int:
        files = list((self.root / f"results/.work/generate/{dataset}").glob("*.jsonl"))
        return len(files[0].read_text().splitlines()) if files else 0


class Arrivals:
    """Which dataset each request the server receives comes from, and when (a fault hook
    that never faults)."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, str]] = []
        self._lock = threading.Lock()

    def __call__(self, body: dict[str, Any], attempt: int) -> None:
        user = next(m["content"] for m in body["messages"] if m["role"] == "user")
        with self._lock:
            self.seen.append((time.monotonic(), user.split()[0]))

    def of(self, dataset: str) -> list[float]:
        return [t for t, d in self.seen if d == dataset]

    def alternations(self) -> int:
        """How often the sender changes along the arrivals: many when the datasets
        generate together, one when they take turns."""
        order = [d for _, d in sorted(self.seen)]
        return sum(1 for a, b in itertools.pairwise(order) if a != b)


def finish(proc: subprocess.Popen[str], timeout: float = 120) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out


# Each answer holds the server 0.1 s (20 tokens at 200 tokens/s): 24 prompts (30 requests)
# of one dataset at 4 in flight take about 0.8 s alone.
SERVER = {"mean_tokens": 20, "token_spread": 5, "tokens_per_s": 200}


def test_two_datasets_generate_at_once_within_one_concurrency(tmp_path: Path) -> None:
    arrivals = Arrivals()
    with FakeOpenAIServer(faults=arrivals, **SERVER) as server:
        # One at a time, each alone with the whole concurrency: the reference outputs.
        alone = Datasets(tmp_path / "alone", server.url)
        for dataset in ("A1", "B2"):
            alone.run_in_process(dataset)
        assert server.stats["max_in_service"] == CONCURRENCY
        server.reset()
        arrivals.seen.clear()

        together = Datasets(tmp_path / "together", server.url)
        go = tmp_path / "go"
        jobs = {d: together.start(d, go) for d in ("A1", "B2")}
        go.touch()
        logs = {d: finish(job) for d, job in jobs.items()}
        peak = server.stats["max_in_service"]

    a, b = arrivals.of("A1"), arrivals.of("B2")
    assert max(a[0], b[0]) < min(a[-1], b[-1]), "the two jobs sent requests at the same time"
    assert arrivals.alternations() >= 10, arrivals.alternations()
    assert peak <= CONCURRENCY, f"the server held {peak} requests at once: the jobs did not share"
    for dataset in ("A1", "B2"):
        assert together.output(dataset) == alone.output(dataset), "as generated alone"
        assert "shared with the run's other generate jobs" in logs[dataset]
    slots = tmp_path / "together/results/.work/endpoint-slots" / endpoint_key(server.url)
    assert sorted(p.name for p in slots.iterdir())[:1] == ["endpoint.txt"]
    assert list((slots / "jobs").iterdir()) == [], "both jobs left"


def test_a_job_killed_mid_run_frees_its_slots_and_resumes_to_the_same_output(
    tmp_path: Path,
) -> None:
    with FakeOpenAIServer(**SERVER) as server:
        alone = Datasets(tmp_path / "alone", server.url)
        alone.run_in_process("A1")
        server.reset()

        run = Datasets(tmp_path / "run", server.url)
        go = tmp_path / "go"
        victim, survivor = run.start("A1", go), run.start("B2", go)
        go.touch()
        deadline = time.monotonic() + 60
        while run.journal_lines("A1") < 10:
            assert victim.poll() is None, "A1 finished before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.01)
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
        # The survivor goes on with every slot: the kill left none taken.
        finish(survivor)
        slots = EndpointSlots(slot_root(Results(run.root)), server.url, CONCURRENCY)
        assert [slots.take() is not None for _ in range(CONCURRENCY)] == [True] * CONCURRENCY
        slots.close()
        assert list((slots.directory / "jobs").iterdir()) == []

        finish(run.start("A1", go))  # the same command again
        peak = server.stats["max_in_service"]
    assert run.output("A1") == alone.output("A1")
    assert peak <= CONCURRENCY


# --------------------------------------------------------------------------- one job's driver


def test_a_conversation_stopped_before_its_first_request_gives_its_slot_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver takes a slot for each new conversation before sending it; one cancelled
    before its first request took it (here: a stop while none has) returns it."""
    from support.fakes import make_prompt

    from eagle3data.errors import GenerationAborted
    from eagle3data.generation import driver, streaming
    from eagle3data.generation.engines.openai_engine import HttpSettings, OpenAIEngine

    stopping: list[threading.Timer] = []

    async def never_sends(engine: Any, flight: Any) -> Any:
        if not stopping:  # once: the run's own SIGTERM handler is there until it ends
            stopping.append(threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)))
            stopping[0].start()
        await asyncio.Event().wait()

    monkeypatch.setattr(streaming, "_converse", never_sends)
    engines: list[OpenAIEngine] = []
    given_back: list[Any] = []

    def factory() -> OpenAIEngine:
        settings = HttpSettings(
            endpoints=[server.url], model="fake-model", concurrency=3, slot_dir=str(tmp_path)
        )
        engine = OpenAIEngine(settings, sampling=SAMPLING, seed=0)
        back = engine.return_slot
        monkeypatch.setattr(engine, "return_slot", lambda s: (given_back.append(s), back(s)))
        engines.append(engine)
        return engine

    job = driver.GenerationJob(
        dataset="A1",
        prompts=[make_prompt(f"p{i}", [{"role": "user", "content": f"q {i}"}]) for i in range(8)],
        journal=tmp_path / "journal.jsonl",
        model="fake-model",
        sampling=SAMPLING,
        progress_interval_s=0,
    )
    with FakeOpenAIServer() as server, pytest.raises(GenerationAborted, match="SIGTERM"):
        driver.run_generation(job, factory, streaming=True)
    assert len(given_back) == 3, "each of the three conversations sent gave its slot back"
    assert [e.in_flight for e in engines[0].pool.endpoints] == [0]
