"""The ``hidden_states`` rule on SGLang's own CPU engine at one rank and at several, as
Kimi-K2.5 runs on its 8-GPU server (tensor parallel, data-parallel attention, expert
parallel), through the README's command, with the checks the data gets at one rank.

Three targets, each generated and tokenized once (transformers), then captured in rounds
that change only ``hidden_states.sglang`` (``snakemake --forcerun hidden_states`` on the
manifest): the tiny Llama, the Kimi-shaped DeepSeek-V3 checkpoint (aux layers 2, 3, 5:
SGLang's other DeepSeek branch of the layer-id rule) and the same decoder as K2.5 ships it
(the multimodal wrapper, Kimi's remote-code tokenizer). Each round is checked for:

* states against a float32 transformers forward of the target (aux layers and the final
  state, per token: pre-norm, the default, and post-norm in one round of the Llama), one
  row per token, the manifest's agreement and control;
* which ranks wrote the rows (the job log's hand-off line): at tp 2 the first rank only,
  with data-parallel attention the first rank of each group, every row exactly once;
* on the Llama, the cosine of the tp 2 states to the one-rank ones (printed: the all-reduce
  sums in another order); on the wrapper, the lists hand-off byte-identical to the
  shared-memory one (one target is enough: the hand-off does not depend on the model, and a
  round costs ~40 s).

The rounds: the Llama at tp 1, tp 2 and tp 2 post-norm; the checkpoint at tp 1 (its decoder
runs at two ranks as the wrapper); the wrapper at tp 2 through both hand-offs and with
data-parallel attention, K2.5's layouts.

Expert parallelism does not run on SGLang's CPU path: its native MoE (``moe_forward_native``)
cannot take the expert ids that expert parallelism masks to -1; the test shows that error.

Faults, on the K2.5 wrapper at tp 2, each in the middle of a shard: ``kill -9`` of worker
rank TP1 (the job fails with one line naming it), SIGTERM to the job (every rank stops) and
``kill -9`` of the whole run; after each, no process of the run is left and ``/dev/shm``
holds what it held before the module; the same command then ends byte-identical to the
uninterrupted tp 2 round.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from support.sglang_cpu import CPU_ENGINE_ARGS, sglang_env
from support.target_models import (
    forward_with_pre_norm,
    kimi_text_decoder,
    make_kimi_dir,
    make_llama_dir,
)
from support.workflow import (
    Workflow,
    kill_group,
    new_workflow,
    read_shard_states,
    sharegpt_prompts,
    write_prompts,
)

from eagle3data.servers.processes import descendants

DATASET = "A1"
RESULTS = f"results/hidden_states/{DATASET}"
MANIFEST = f"{RESULTS}/manifest.json"
SHARD_LOG = f"logs/hidden_states/{DATASET}"
ENGINE_LOG = "logs/capture_engines"

TP1: dict[str, Any] = {"tp_size": 1}
TP2: dict[str, Any] = {"tp_size": 2}
DP_ATTENTION: dict[str, Any] = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True}
EP2: dict[str, Any] = {"tp_size": 2, "ep_size": 2}

HANDOFF_LINE = re.compile(r"sglang hand-off: (.*)")
WROTE = re.compile(r"(scheduler[\w ]*) \(pid \d+\) wrote \d+ batch(?:es)?, ([\d,]+) rows")
REPLICA = re.compile(r"(scheduler[\w ]*) \(pid \d+\) holds replicas, wrote none")


def engine_ranks(layout: dict[str, Any]) -> int:
    if layout.get("enable_dp_attention"):
        return int(layout["tp_size"])
    return int(layout["tp_size"]) * int(layout.get("dp_size", 1))


@dataclass
class Round:
    """What one capture round left: shard bytes, states per sample, manifest, job logs."""

    name: str
    shards: dict[str, bytes]
    states: dict[str, tuple[torch.Tensor, torch.Tensor, list[int]]]
    layers: list[int]
    manifest: dict[str, Any]
    logs: str
    final_state: str


class Target:
    """One target's workflow: prompts generated and tokenized once, captured by round."""

    def __init__(
        self,
        base: Path,
        model_dir: Path,
        reference: Callable[[], torch.nn.Module],
        *,
        prompts: int,
        kimi: bool,
        aux_layers: str | list[int] = "auto",
    ) -> None:
        path = write_prompts(base / "prompts.jsonl", sharegpt_prompts(prompts))
        model: dict[str, Any] = {}
        if kimi:
            model = {"trust_remote_code": True, "chat_template_kwargs": {"thinking": False}}
        self.wf = new_workflow(
            base,
            model_dir,
            {DATASET: {"path": str(path), "format": "sharegpt"}},
            model=model,
            generation={"sampling": {"temperature": 0.0, "max_tokens": 32}},
            hidden_states={
                "backend": "sglang",
                "device": "cpu",
                "dtype": "bfloat16",
                "aux_layers": aux_layers,
                # One shard of batches of about one conversation each: a kill lands in the
                # middle of it, and one engine start per round.
                "shard_bytes": 64 * 2**20,
                "batch_tokens": 96,
            },
            validate={"agreement": {"enabled": True, "positions_per_shard": "all"}},
        )
        if kimi:
            self.wf.env["TIKTOKEN_CACHE_DIR"] = str(base / "tiktoken-cache")
        self.reference = reference
        self.rounds = 0

    def configure(
        self, layout: dict[str, Any], handoff: str, final_state: str = "pre_norm"
    ) -> None:
        hidden = self.wf.config["hidden_states"]
        hidden["final_state"] = final_state
        hidden["sglang"] = {
            **layout,
            "handoff": handoff,
            "mem_fraction_static": 0.5,
            # The CPU engine's options (device is hidden_states.device); the Kimi fixture
            # has no image processor: a text-only engine, as the GPU check.
            "extra_args": {
                **{k: v for k, v in CPU_ENGINE_ARGS.items() if k != "device"},
                "enable_multimodal": False,
            },
        }
        self.wf.write_config()
        self.wf.env.update(sglang_env({}, ranks=engine_ranks(layout)))
        if engine_ranks(layout) == 1:
            self.wf.env.pop("SGLANG_CPU_OMP_THREADS_BIND", None)

    def command(self) -> list[str]:
        """The README's command: everything the first time; then the manifest, with the
        shard jobs forced (only the execution settings changed)."""
        self.rounds += 1
        return [] if self.rounds == 1 else [MANIFEST, "--forcerun", "hidden_states"]

    def clear_logs(self) -> None:
        for log in [*self.wf.path(SHARD_LOG).glob("*.log"), *self.wf.path(ENGINE_LOG).glob("*")]:
            log.unlink()

    def capture(
        self,
        name: str,
        layout: dict[str, Any],
        handoff: str = "shared_memory",
        final_state: str = "pre_norm",
    ) -> Round:
        self.configure(layout, handoff, final_state)
        self.clear_logs()
        self.wf.run(*self.command(), timeout=1200)
        return self.collect(name)

    def logs(self) -> str:
        return "".join(p.read_text() for p in sorted(self.wf.path(SHARD_LOG).glob("*.log")))

    def engine_logs(self) -> str:
        """The capture engines' own logs: the target's load, SGLang's workers' output."""
        return "".join(p.read_text() for p in sorted(self.wf.path(ENGINE_LOG).glob("*.log")))

    def collect(self, name: str) -> Round:
        read = read_shard_states(self.wf.path(RESULTS))
        manifest = json.loads(self.wf.path(MANIFEST).read_text())
        return Round(
            name, read.shards, read.states, read.layers, manifest, self.logs(), read.final_state
        )


def llama_reference(model_dir: Path) -> Callable[[], torch.nn.Module]:
    def load() -> torch.nn.Module:
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    return load


def kimi_reference(model_dir: Path) -> Callable[[], torch.nn.Module]:
    return lambda: kimi_text_decoder(model_dir).float().eval()


# --- checks -------------------------------------------------------------------------------


def cosines(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(got, want, dim=-1)


def check_against_the_target(target: Target, rnd: Round) -> None:
    """Every sample's rows against a float32 forward of the target, one row per token.

    bf16 (SGLang) against float32: the Kimi fixture routes each token to 2 of 4 experts,
    and a near tie can pick another expert for a single token (seen: one token of 758 at
    0.968, every other at 1.0000)."""
    model = target.reference()
    for sample_id, (aux, last, ids) in rnd.states.items():
        assert aux.shape[0] == last.shape[0] == len(ids), f"{rnd.name} {sample_id}: rows"
        out, pre = forward_with_pre_norm(model, ids)
        want_aux = torch.cat([out.hidden_states[k + 1][0] for k in rnd.layers], -1)
        want_last = {"pre_norm": pre, "post_norm": out.hidden_states[-1][0]}[rnd.final_state]
        for got, want in ((aux, want_aux), (last, want_last)):
            # Cosines cannot tell the two final states apart where the norm's weight is 1
            # (the fixtures'): their sizes can.
            size = ((got - want).norm(dim=-1) / want.norm(dim=-1)).median().item()
            assert size < 0.05, f"{rnd.name} {sample_id}: relative difference {size:.4f}"
            cos = cosines(got, want)
            assert cos.mean().item() > 0.999 and cos.min().item() > 0.9, (
                f"{rnd.name} {sample_id}: cosine to the target mean {cos.mean():.5f} "
                f"min {cos.min():.5f}"
            )


def check_manifest(rnd: Round, samples: int) -> None:
    manifest = rnd.manifest
    assert manifest["num_samples"] == samples
    check = manifest["agreement"]
    assert check["greedy"] and check["positions"] > 100
    assert check["agreement"] >= 0.9 > 0.1 >= check["control_agreement"], check


def check_writers(rnd: Round, writers: list[str], replicas: list[str]) -> None:
    """The hand-off line of every shard job: ``writers`` wrote every row once, ``replicas``
    wrote none."""
    lines = HANDOFF_LINE.findall(rnd.logs)
    assert len(lines) == len(rnd.shards), rnd.logs[-3000:]
    tokens = sum(len(ids) for _, _, ids in rnd.states.values())
    rows = 0
    for line in lines:
        wrote = {name: int(n.replace(",", "")) for name, n in WROTE.findall(line)}
        assert sorted(wrote) == sorted(writers), line
        assert sorted(REPLICA.findall(line)) == sorted(replicas), line
        rows += sum(wrote.values())
    assert rows == tokens, f"{rows} rows handed over for {tokens} tokens"


def compare_rounds(a: Round, b: Round) -> dict[str, float]:
    """Per-token cosine of two rounds' states over all samples (aux and final state)."""
    assert a.states.keys() == b.states.keys()
    result = {}
    for part, name in ((0, "aux"), (1, "last")):
        cos = torch.cat([cosines(a.states[k][part], b.states[k][part]) for k in a.states])
        result[f"{name}_min"] = cos.min().item()
        result[f"{name}_mean"] = cos.mean().item()
    return result


def report_cosine(target: str, a: Round, b: Round) -> dict[str, float]:
    result = compare_rounds(a, b)
    print(
        f"{target}: {b.name} vs {a.name} per-token cosine: aux mean {result['aux_mean']:.6f} "
        f"min {result['aux_min']:.6f}; final state mean {result['last_mean']:.6f} "
        f"min {result['last_min']:.6f}"
    )
    assert result["aux_mean"] > 0.999 and result["last_mean"] > 0.999, result
    assert result["aux_min"] > 0.9 and result["last_min"] > 0.9, result
    return result


def job_failure(logs: str) -> str:
    """The one line the failed job ended with (run_step's error): the job's last ERROR
    line, once. SGLang's own loggers write to the job log too, also as ERROR (its
    watchdog's "Subprocess ... crashed"), before it."""
    ours = re.findall(r"^\S+ \S+ ERROR (SGLang worker .*)$", logs, flags=re.MULTILINE)
    errors = re.findall(r"^\S+ \S+ ERROR (.*)$", logs, flags=re.MULTILINE)
    assert len(ours) == 1 and errors[-1] == ours[0], logs[-4000:]
    return ours[0]


# --- the run's processes and shared memory ---------------------------------------------


def shm_listing() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def sglang_processes() -> list[str]:
    """Titles of every SGLang process on the machine (the suite runs one engine at once)."""
    titles = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode()
            except OSError:
                continue
            if title.startswith("sglang::"):
                titles.append(f"{title} (pid {entry.name})")
    return titles


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def check_nothing_left(baseline: set[str], group: int | None = None) -> None:
    """No SGLang process and no process of the run's group; /dev/shm as before the module."""
    wait_for(lambda: not sglang_processes(), f"SGLang processes left: {sglang_processes()}")
    if group is not None:

        def group_gone() -> bool:
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                return True
            return False

        wait_for(group_gone, f"processes of the run's group {group} left")
    wait_for(
        lambda: shm_listing() == baseline,
        f"/dev/shm holds {sorted(shm_listing() - baseline)} more than before the module",
    )


@pytest.fixture(scope="module")
def shm_baseline() -> set[str]:
    return shm_listing()


# --- targets -------------------------------------------------------------------------------


def captured_in_rounds(
    target: Target, *rounds: tuple[str, str, dict[str, Any], str]
) -> dict[str, Any]:
    """``rounds`` as (key, name, layout, hand-off), captured in that order; the target
    itself under ``"target"``."""
    captured: dict[str, Any] = {"target": target}
    for key, name, layout, handoff in rounds:
        captured[key] = target.capture(name, layout, handoff)
    return captured


ROUND_TP1 = ("tp1", "tp 1", TP1, "shared_memory")
ROUND_TP2 = ("tp2", "tp 2", TP2, "shared_memory")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("llama")
    model_dir = make_llama_dir(base / "tiny-llama")
    rounds = captured_in_rounds(
        Target(base, model_dir, llama_reference(model_dir), prompts=6, kimi=False),
        ROUND_TP1,
        ROUND_TP2,
    )
    rounds["tp2-post"] = rounds["target"].capture("tp 2, post-norm", TP2, final_state="post_norm")
    return rounds


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The plain DeepSeek-V3 checkpoint, aux layers 2, 3, 5: sent to SGLang as
    hidden_states indices (its other DeepSeek branch of the layer-id rule). One rank: the
    same decoder runs at two ranks as the K2.5 wrapper below, and the rule does not depend
    on the layout."""
    base = tmp_path_factory.mktemp("kimi")
    model_dir = make_kimi_dir(base / "Kimi-K2.5-tiny", wrapper=False)
    return captured_in_rounds(
        Target(
            base, model_dir, kimi_reference(model_dir), prompts=6, kimi=True, aux_layers=[2, 3, 5]
        ),
        ROUND_TP1,
    )


@pytest.fixture(scope="module")
def kimi_wrapper(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("kimi-wrapper")
    model_dir = make_kimi_dir(base / "Kimi-K2.5-tiny", wrapper=True)
    # Its layouts as K2.5 is served, at two ranks (one rank runs on the Llama and the
    # checkpoint; every round is checked against the target itself), and both hand-offs on
    # the target as K2.5 ships it (~40 s a round).
    return captured_in_rounds(
        Target(base, model_dir, kimi_reference(model_dir), prompts=10, kimi=True),
        ROUND_TP2,
        ("tp2-lists", "tp 2, lists", TP2, "lists"),
        ("dp-attention", "tp 2, data-parallel attention 2", DP_ATTENTION, "shared_memory"),
    )


def check_target(name: str, rounds: dict[str, Any], samples: int) -> None:
    """The rounds at one rank, two, and through the lists hand-off, those the target ran."""
    target: Target = rounds["target"]
    tp1, tp2, lists = rounds.get("tp1"), rounds.get("tp2"), rounds.get("tp2-lists")
    for rnd in (tp1, tp2, lists):
        if rnd is not None:
            check_manifest(rnd, samples)
            check_against_the_target(target, rnd)
    if tp1 is not None:
        check_writers(tp1, ["scheduler"], [])
    if tp2 is not None:
        check_writers(tp2, ["scheduler TP0"], ["scheduler TP1"])
    if lists is not None:
        assert tp2 is not None
        assert HANDOFF_LINE.findall(lists.logs) == []  # lists: SGLang returns the rows itself
        # Both hand-offs carry the same bf16 values from the same engine: the same bytes.
        assert lists.shards == tp2.shards
    if tp1 is not None and tp2 is not None:
        report_cosine(name, tp1, tp2)


def test_llama_at_one_and_two_ranks(llama: dict[str, Any]) -> None:
    check_target("llama", llama, samples=6)
    assert llama["tp1"].layers == [1, 3, 4]


def test_llama_post_norm_capture_is_the_targets_norm_of_the_pre_norm_one(
    llama: dict[str, Any],
) -> None:
    """final_state: post_norm takes the logits processor's input, the pre-norm default the
    final norm's: the same aux bytes, and the target's own norm of one is the other."""
    pre, post = llama["tp2"], llama["tp2-post"]
    assert (pre.final_state, post.final_state) == ("pre_norm", "post_norm")
    check_manifest(post, 6)
    check_against_the_target(llama["target"], post)
    norm = llama["target"].reference().model.norm
    for key, (aux, last, _) in pre.states.items():
        post_aux, post_last, _ = post.states[key]
        assert torch.equal(aux, post_aux)
        with torch.inference_mode():
            normed = norm(last)
        # bf16 rounding: SGLang's kernel normalizes the float32 sum before rounding it.
        size = ((normed - post_last).norm(dim=-1) / post_last.norm(dim=-1)).max().item()
        assert size < 0.02, f"{key}: relative difference {size:.4f}"


def test_kimi_checkpoint_at_one_rank(kimi: dict[str, Any]) -> None:
    check_target("kimi (DeepseekV3ForCausalLM)", kimi, samples=6)
    assert kimi["tp1"].layers == [2, 3, 5]


def test_kimi_expert_parallel_stops_in_sglangs_native_moe(
    kimi: dict[str, Any], shm_baseline: set[str]
) -> None:
    """ep_size 2 on SGLang's CPU path: its native MoE indexes a count tensor with the
    expert ids that expert parallelism masks to -1 for another rank's experts; not ours
    to change. The job fails with SGLang's error above one line naming the ranks."""
    target: Target = kimi["target"]
    target.configure(EP2, "shared_memory")
    target.clear_logs()
    proc = target.wf.run(*target.command(), check=False, timeout=1200)
    assert proc.returncode != 0
    logs = target.logs()
    # SGLang's workers print their traceback to the capture engine's log.
    assert "moe_forward_native" in target.engine_logs()
    assert "RuntimeError: index -1 is out of bounds for dimension 1" in target.engine_logs()
    failure = job_failure(logs)
    assert re.match(r"SGLang worker scheduler TP\d EP\d \(pid \d+\) ended after an error", failure)
    check_nothing_left(shm_baseline)


def test_kimi_wrapper_at_tp2_with_both_handoffs(kimi_wrapper: dict[str, Any]) -> None:
    check_target("kimi-wrapper (KimiK25ForConditionalGeneration)", kimi_wrapper, samples=10)


def test_kimi_wrapper_with_data_parallel_attention(kimi_wrapper: dict[str, Any]) -> None:
    rnd = kimi_wrapper["dp-attention"]
    check_manifest(rnd, 10)
    check_against_the_target(kimi_wrapper["target"], rnd)
    # Each attention group computed its own requests and wrote them; none was lost or
    # written twice.
    check_writers(rnd, ["scheduler DP0 TP0", "scheduler DP1 TP1"], [])
    report_cosine("kimi-wrapper", kimi_wrapper["tp2"], rnd)


# --- faults --------------------------------------------------------------------------------


def wait_for_partial_shard(wf: Workflow, proc: subprocess.Popen[str], timeout: float = 600) -> None:
    """Until a shard job is writing (its hidden temp file exists): the engine is up."""
    deadline = time.monotonic() + timeout
    while not list(wf.path(RESULTS).glob(".shard-*.tmp")):
        assert proc.poll() is None, "the run ended before a shard job was caught writing"
        assert time.monotonic() < deadline, "no shard job started writing in time"
        time.sleep(0.02)


def pid_titled(title: str) -> int:
    """The SGLang process titled ``title`` (the suite runs one engine at a time; the
    capture engine that runs it is no child of the run once its first shard job ends)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().split(b"\0")[0].decode() == title:
                    return int(entry.name)
            except OSError:
                continue
    raise AssertionError(f"no process titled {title}: {sglang_processes()}")


def job_pid(proc: subprocess.Popen[str]) -> int:
    """The shard job: the run's Python process that runs the extract_hidden_states script
    (the deepest match: Snakemake may start it through a shell, whose command line names
    the script too, and which would not pass a SIGTERM on)."""
    jobs = [w.pid for w in descendants(proc.pid) if "extract_hidden_states" in w.title]
    assert jobs, "no shard job in the run"
    return jobs[-1]


def test_faults_in_the_middle_of_a_shard_then_the_same_command_ends_identical(
    kimi_wrapper: dict[str, Any], shm_baseline: set[str]
) -> None:
    target: Target = kimi_wrapper["target"]
    wf = target.wf
    target.configure(TP2, "shared_memory")
    # The capture not done yet, as on a first run; every run below is the same command.
    shutil.rmtree(wf.path("results/hidden_states"))

    # kill -9 of worker rank TP1: the job fails with one line that names it.
    target.clear_logs()
    proc = wf.start(MANIFEST)
    wait_for_partial_shard(wf, proc)
    os.kill(pid_titled("sglang::scheduler_TP1"), signal.SIGKILL)
    assert proc.wait(timeout=300) != 0
    failure = job_failure(target.logs())
    assert re.match(r"SGLang worker scheduler TP1 \(pid \d+\) was killed by SIGKILL; ", failure)
    assert not list(wf.path(RESULTS).glob("shard-*.h5")), "no half-written shard is accepted"
    check_nothing_left(shm_baseline, proc.pid)

    # SIGTERM to the job: every rank stops, and the job says so.
    target.clear_logs()
    proc = wf.start(MANIFEST)
    wait_for_partial_shard(wf, proc)
    os.kill(job_pid(proc), signal.SIGTERM)
    assert proc.wait(timeout=300) != 0
    assert "capture_with_engine stopped by SIGTERM" in target.logs()
    check_nothing_left(shm_baseline, proc.pid)

    # kill -9 of the whole run: the engine's reaper removes what the job cannot.
    proc = wf.start(MANIFEST)
    wait_for_partial_shard(wf, proc)
    assert kill_group(proc, signal.SIGKILL) != 0
    check_nothing_left(shm_baseline, proc.pid)
    wf.run("--unlock")

    wf.run(MANIFEST, timeout=1200)
    done = target.collect("tp 2 after the faults")
    assert done.shards == kimi_wrapper["tp2"].shards
    assert not list(wf.path(RESULTS).glob(".shard-*.tmp")), "no temp file left behind"
    check_nothing_left(shm_baseline)


# --- one load per phase ---------------------------------------------------------------------

STARTED = re.compile(r"started capture engine (\S+) \(pid (\d+)")
WRITER_PID = re.compile(r"sglang hand-off: scheduler \(pid (\d+)\) wrote")


def test_one_engine_start_per_phase_and_a_killed_run_resumes_identical(
    llama: dict[str, Any], shm_baseline: set[str]
) -> None:
    """The Llama at one rank, one conversation per shard (six or more shards): each run
    starts SGLang once (one "started capture engine" line, and one scheduler pid in every
    shard's hand-off line: SGLang's own word); ``kill -9`` of the run after two shards
    leaves nothing, and the same command ends byte-identical to the uninterrupted run.
    Last in the module: it changes the Llama's shard size."""
    target: Target = llama["target"]
    wf = target.wf
    target.configure(TP1, "shared_memory")
    wf.config["hidden_states"]["shard_bytes"] = 1  # every conversation a shard of its own
    wf.write_config()
    target.clear_logs()
    wf.run(MANIFEST, timeout=1200)
    whole = read_shard_states(wf.path(RESULTS)).shards
    assert len(whole) >= 6
    logs = target.logs()
    assert len(STARTED.findall(logs)) == 1, logs[-3000:]
    assert len(WRITER_PID.findall(logs)) == len(whole)
    assert len(set(WRITER_PID.findall(logs))) == 1, "one SGLang engine wrote every shard"
    check_nothing_left(shm_baseline)

    for shard in [*wf.path(RESULTS).glob("shard-*.h5"), wf.path(MANIFEST)]:
        shard.unlink()
    target.clear_logs()
    proc = wf.start(MANIFEST)
    deadline = time.monotonic() + 600
    # A shard of a warm engine takes less than the poll can catch writing: kill once two
    # are done (the run is then in its third shard, or between two shard jobs).
    while len(list(wf.path(RESULTS).glob("shard-*.h5"))) < 2:
        assert proc.poll() is None, "the capture ended before it could be killed"
        assert time.monotonic() < deadline, "no third shard started in time"
        time.sleep(0.02)
    assert kill_group(proc, signal.SIGKILL) != 0
    assert len(list(wf.path(RESULTS).glob("shard-*.h5"))) < len(whole), "killed before the end"
    check_nothing_left(shm_baseline, proc.pid)
    assert len(STARTED.findall(target.logs())) == 1
    wf.run("--unlock")
    target.clear_logs()
    wf.run(MANIFEST, timeout=1200)
    assert read_shard_states(wf.path(RESULTS)).shards == whole
    logs = target.logs()
    assert len(STARTED.findall(logs)) == 1, logs[-3000:]
    assert len(set(WRITER_PID.findall(logs))) == 1
    assert not list(wf.path(RESULTS).glob(".shard-*.tmp"))
    check_nothing_left(shm_baseline)
