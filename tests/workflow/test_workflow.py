"""End-to-end: the real Snakemake workflow on a tiny random model.

Checks the documented contract (docs/how-to/budgets.md, docs/reference/outputs.md) on real
files: budgets, prefix order, formats, hidden states equal to a direct transformers forward,
nothing re-planned on a second run, kill-and-resume without loss or duplication, budget
changes.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import h5py
import polars as pl
import pytest
import torch
from support.workflow import (
    Workflow,
    new_workflow,
    sharegpt_prompts,
    two_datasets,
    write_prompts,
)

from eagle3data.hidden_states.layers import default_aux_layer_ids
from eagle3data.shards import open_shard

pytestmark = pytest.mark.e2e

ROW_FIELDS = {"id", "dataset", "index", "messages", "finish_reason", "usage", "model", "sampling"}


@pytest.fixture
def finished(finished_run: Workflow) -> Workflow:
    """One complete run (tests/conftest.py) shared by the read-only tests of this module."""
    return finished_run


@pytest.fixture(scope="module")
def generated_once(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Workflow:
    """A1's responses only: generated once, copied for each test that changes it."""
    base = tmp_path_factory.mktemp("generated")
    wf = new_workflow(base, tiny_model_dir, two_datasets(base))
    wf.run("results/responses/A1.jsonl")
    return wf


@pytest.fixture
def generated(generated_once: Workflow, tmp_path: Path) -> Workflow:
    """A1's responses only, in a workflow of its own (a copy of ``generated_once``: files,
    times and Snakemake's records), for tests that change the config."""
    return generated_once.copy(tmp_path)


def test_responses_obey_budget_and_prefix_order(finished: Workflow) -> None:
    for ds, limit in (("A1", "token_budget"), ("B2", "max_samples")):
        rows = finished.responses(ds)
        order = pl.read_parquet(finished.path(f"results/prompts/{ds}.parquet")).sort("index")
        ids = order["id"].to_list()
        assert rows, ds
        # The output is the prefix of the seeded order (no failures here).
        assert [r["id"] for r in rows] == ids[: len(rows)]
        assert [r["index"] for r in rows] == list(range(len(rows)))
        for r in rows:
            assert set(r) >= ROW_FIELDS
            assert r["dataset"] == ds
            assert r["messages"][-1]["role"] == "assistant"
            assert r["finish_reason"] in {"stop", "length"}
        stats = finished.stats(ds)
        assert stats["in_output"] + stats["failed"] + stats["beyond_limits"] == stats["prompts"]
        if limit == "token_budget":
            used = sum(r["usage"]["completion_tokens"] for r in rows)
            assert used <= 100
            # Longest prefix: the next prompt would not have fitted.
            assert stats["stop_reason"] in {"token_budget", "exhausted"}
            assert used == stats["completion_tokens"]
        else:
            assert len(rows) == 7 and stats["stop_reason"] == "max_samples"


def test_multi_turn_prompts_regenerate_every_assistant_turn(finished: Workflow) -> None:
    prompts = pl.read_parquet(finished.path("results/prompts/A1.parquet"))
    by_id = {r["id"]: r["messages"] for r in prompts.iter_rows(named=True)}
    multi = [
        r for r in finished.responses("A1") if sum(m["role"] == "user" for m in r["messages"]) > 1
    ]
    assert multi, "the budget prefix should contain a multi-turn prompt"
    for r in multi:
        source = by_id[r["id"]]
        roles = [m["role"] for m in r["messages"]]
        users = [m["content"] for m in r["messages"] if m["role"] == "user"]
        assert users == [m["content"] for m in source if m["role"] == "user"]
        body = roles[1:] if roles[0] == "system" else roles
        assert body == ["user", "assistant"] * (len(body) // 2)
        source_answers = {m["content"] for m in source if m["role"] == "assistant"}
        assert not source_answers & {
            m["content"] for m in r["messages"] if m["role"] == "assistant"
        }
        assert len(r["turns"]) == len(users)


def test_hidden_states_equal_a_direct_forward(finished: Workflow, tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    aux_ids = default_aux_layer_ids(8)
    for ds in ("A1", "B2"):
        manifest = json.loads(
            finished.path(f"results/hidden_states/{ds}/manifest.json").read_text()
        )
        tokenized = pl.read_parquet(finished.path(f"results/tokenized/{ds}.parquet"))
        assert manifest["num_samples"] == tokenized.height == len(finished.responses(ds))
        assert manifest["num_shards"] >= 2, "shard_bytes is small enough to need several shards"
        seen = []
        for entry in manifest["shards"]:
            path = finished.path(f"results/hidden_states/{ds}/{entry['file']}")
            with open_shard(path) as shard:
                assert shard.attrs["aux_layer_ids"] == list(aux_ids)
                assert shard.attrs["aux_hidden_states_indices"] == [i + 1 for i in aux_ids]
                assert shard.attrs["final_state"] == "pre_norm"  # the default
                assert shard.hidden_dtype == "bfloat16"
                for i in range(shard.num_samples):
                    s = shard.sample(i)
                    seen.append(s["id"])
                    ids = torch.tensor(s["input_ids"], dtype=torch.long)[None]
                    with torch.inference_mode():
                        out = model(ids, output_hidden_states=True)
                    want_aux = torch.cat([out.hidden_states[k + 1][0] for k in aux_ids], -1)
                    want_last = out.hidden_states[-1][0]  # post-norm
                    got_aux = torch.from_numpy(s["aux_hidden_states"])
                    # The pre-norm state: the model's own final norm of it is the post-norm.
                    with torch.inference_mode():
                        got_last = model.model.norm(
                            torch.from_numpy(s["last_hidden_states"]).to(want_last.dtype)
                        ).float()
                    # bf16: a few ulps of difference from batching/padding are fine.
                    torch.testing.assert_close(got_aux, want_aux.float(), rtol=2e-2, atol=2e-2)
                    torch.testing.assert_close(got_last, want_last.float(), rtol=2e-2, atol=2e-2)
                    assert s["loss_mask"].sum() > 0
        assert seen == tokenized["id"].to_list()
        # Bits on disk are bf16 bit patterns, as documented.
        with h5py.File(finished.path(f"results/hidden_states/{ds}/shard-00000.h5")) as f:
            assert f["aux_hidden_states"].dtype == "uint16"
            assert f.attrs["hidden_encoding"] == "bfloat16-bits-as-uint16"


def test_second_run_plans_nothing_and_single_targets_work(finished: Workflow) -> None:
    assert finished.plans_nothing()
    assert finished.plans_nothing("results/responses/B2.jsonl")


def test_budget_changes_reuse_the_sidecar(generated: Workflow) -> None:
    finished = generated
    before = finished.journal_lines("A1")
    rows_before = finished.responses("A1")
    finished.config["datasets"]["A1"]["token_budget"] = 200
    finished.write_config()
    finished.run("results/responses/A1.jsonl")
    after = finished.journal_lines("A1")
    assert after[: len(before)] == before, "existing records are kept as they are"
    stats = finished.stats("A1")
    assert stats["records_resumed"] == len(before)
    assert stats["records_generated_now"] == len(after) - len(before) > 0
    assert stats["completion_tokens"] <= 200
    assert finished.responses("A1")[: len(rows_before)] == rows_before

    finished.config["datasets"]["A1"]["token_budget"] = 50
    finished.write_config()
    finished.run("results/responses/A1.jsonl")
    assert finished.journal_lines("A1") == after, "lowering a budget generates nothing"
    stats = finished.stats("A1")
    assert stats["records_generated_now"] == 0
    assert stats["completion_tokens"] <= 50
    assert finished.responses("A1") == rows_before[: len(finished.responses("A1"))]


def _shard_files(wf: Workflow, ds: str) -> dict[str, tuple[int, int]]:
    """Each shard file's (inode, mtime): equal only if the file was not written again."""
    return {
        p.name: (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in sorted(wf.path(f"results/hidden_states/{ds}").glob("shard-*.h5"))
    }


def _shard_samples(wf: Workflow, ds: str) -> list[tuple]:
    out = []
    for path in sorted(wf.path(f"results/hidden_states/{ds}").glob("shard-*.h5")):
        with open_shard(path) as shard:
            states = (shard.aux_hidden_states().tobytes(), shard.last_hidden_states().tobytes())
            out.append((path.name, shard.sample_ids, shard.input_ids.tolist(), *states))
    return out


def test_budget_changes_extract_only_new_or_changed_shards(
    finished_run: Workflow, make_workflow, tmp_path
) -> None:
    """Raising a budget appends conversations: the full shards before them are kept as
    they are (not extracted again); lowering it removes the shards beyond the plan.
    Either way the shards equal a fresh run's. (The run before the change is a copy of the
    session's finished run, A1 at token_budget 100.)"""
    datasets = {"A1": copy.deepcopy(finished_run.config["datasets"]["A1"])}
    assert datasets["A1"]["token_budget"] == 100
    target = "results/hidden_states/A1/manifest.json"
    wf = finished_run.copy(tmp_path)
    before = _shard_files(wf, "A1")
    assert len(before) >= 3

    wf.config["datasets"]["A1"]["token_budget"] = 200
    wf.write_config()
    wf.run(target)
    after = _shard_files(wf, "A1")
    kept = [name for name in before if after.get(name) == before[name]]
    assert kept and kept == sorted(before)[: len(kept)], "the leading shards are kept"
    assert len(kept) >= len(before) - 1, "only the last shard can change"
    assert len(after) > len(before)
    changed = re.findall(
        r"A1: (\d+) of (\d+) shard\(s\) new or changed",
        wf.path("logs/plan_shards/A1.log").read_text(),
    )
    assert changed[-1] == (str(len(after) - len(kept)), str(len(after)))

    fresh_sets = {"A1": {**datasets["A1"], "token_budget": 200}}
    fresh = make_workflow(fresh_sets, name="fresh")
    fresh.run(target)
    assert _shard_samples(wf, "A1") == _shard_samples(fresh, "A1")
    assert wf.plans_nothing(target)

    wf.config["datasets"]["A1"]["token_budget"] = 40
    wf.write_config()
    wf.run(target)
    plan = json.loads(wf.path("results/hidden_states/A1/plan.json").read_text())
    lowered = _shard_files(wf, "A1")
    assert sorted(lowered) == [f"shard-{s['shard']:05d}.h5" for s in plan["shards"]]
    assert len(lowered) < len(before), "shards beyond the plan are gone"
    assert "no longer planned" in wf.path("logs/plan_shards/A1.log").read_text()
    manifest = json.loads(wf.path(target).read_text())
    assert [s["file"] for s in manifest["shards"]] == sorted(lowered)
    assert wf.plans_nothing(target)


def _planned_datasets(wf: Workflow, *targets: str) -> set[str]:
    lines = wf.run("-n", *targets).stdout.splitlines()
    return {line.split("dataset=")[1].split(",")[0] for line in lines if "dataset=" in line}


def _sidecars(wf: Workflow, dataset: str) -> list[Path]:
    return sorted(wf.path(f"results/.work/generate/{dataset}").glob("*.jsonl"))


def test_a_budget_change_reruns_only_that_dataset(generated: Workflow) -> None:
    wf = generated
    targets = ("results/responses/A1.jsonl", "results/responses/B2.jsonl")
    wf.run(*targets)
    assert wf.plans_nothing(*targets)
    wf.config["datasets"]["B2"]["max_samples"] = 9
    wf.write_config()
    assert _planned_datasets(wf, *targets) == {"B2"}
    wf.config["datasets"]["A1"]["token_budget"] = 150
    wf.write_config()
    assert _planned_datasets(wf, *targets) == {"A1", "B2"}


@pytest.mark.parametrize("change", ["sampling", "model"])
def test_sampling_or_model_change_starts_a_new_sidecar_and_says_so(
    generated: Workflow, tmp_path: Path, tiny_model_dir: Path, change: str
) -> None:
    wf = generated
    [old] = _sidecars(wf, "A1")
    old_bytes = old.read_bytes()
    if change == "sampling":
        wf.config["generation"]["sampling"]["max_tokens"] = 6
    else:  # another model: same architecture, different config
        other = tmp_path / "other-model"
        shutil.copytree(tiny_model_dir, other)
        config = json.loads((other / "config.json").read_text())
        config["rms_norm_eps"] = 1e-5 if config.get("rms_norm_eps") != 1e-5 else 1e-6
        (other / "config.json").write_text(json.dumps(config))
        wf.config["model"]["path"] = str(other)
    wf.write_config()
    assert _planned_datasets(wf, "results/responses/A1.jsonl") == {"A1"}
    wf.run("results/responses/A1.jsonl")

    sidecars = _sidecars(wf, "A1")
    assert len(sidecars) == 2 and old in sidecars
    assert old.read_bytes() == old_bytes, "earlier progress is kept untouched"
    [new] = [p for p in sidecars if p != old]
    log = wf.path("logs/generate/A1.log").read_text()
    assert "generation settings differ from the 1 earlier sidecar(s)" in log
    assert f"starting a new sidecar {new.name}" in log
    stats = wf.stats("A1")
    assert stats["records_resumed"] == 0 and stats["settings_key"] == new.stem
    assert all(r["model"] for r in wf.responses("A1"))


def test_edited_code_reruns_nothing(generated: Workflow) -> None:
    wf = generated
    target = "results/responses/A1.jsonl"
    for rel in ("scripts/generate.py", "src/eagle3data/generation/driver.py", "rules/generate.smk"):
        with wf.path(rel).open("a") as fh:
            fh.write("\n# edited\n")
    assert wf.plans_nothing(target), "the profile's rerun triggers leave out code"
    # Without the profile's triggers Snakemake would redo the generation:
    all_triggers = ("--rerun-triggers", "mtime", "params", "input", "software-env", "code")
    assert "generate" in wf.run("-n", target, *all_triggers).stdout


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Workflow:
    """The responses the killed generations must end with: the same settings, not killed
    (one run for both signals)."""
    base = tmp_path_factory.mktemp("uninterrupted")
    prompts = write_prompts(base / "A1.jsonl", sharegpt_prompts(80))
    datasets = {"A1": {"path": str(prompts), "format": "sharegpt", "token_budget": 400}}
    reference = new_workflow(base, tiny_model_dir, datasets, generation={"batch_size": 2})
    reference.run("results/responses/A1.jsonl")
    return reference


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_killed_generation_resumes_without_loss_or_duplicates(
    make_workflow, uninterrupted: Workflow, sig
) -> None:
    datasets = copy.deepcopy(uninterrupted.config["datasets"])
    wf = make_workflow(datasets, name="killed", generation={"batch_size": 2})
    partial = wf.kill_and_resume("results/responses/A1.jsonl", sig, after_records=6)
    wf.assert_resumed("A1", partial, uninterrupted)


def test_bad_input_fails_the_job_with_one_clear_line(make_workflow, tmp_path) -> None:
    bad = tmp_path / "A1.jsonl"
    bad.write_text(
        '{"id": "a", "conversations": [{"from": "human", "value": "hi"}]}\n'
        '{"id": "b", "conversations": [{"from": "bot", "value": "hi"}]}\n'
    )
    wf = make_workflow({"A1": {"path": str(bad), "format": "sharegpt"}})
    proc = wf.run("results/prompts/A1.parquet", check=False)
    assert proc.returncode != 0
    log = wf.path("logs/prompts/A1.log").read_text()
    assert f"{bad}:2: conversations[0].from: unknown role 'bot'" in log
    assert "Traceback" not in log
    assert not wf.path("results/prompts/A1.parquet").exists()


def test_a_prompt_longer_than_the_context_is_a_recorded_failure(make_workflow, tmp_path) -> None:
    huge = {"prompt": "word " * 200_000}  # 1 MB, ~200k tokens; the tiny model has 512
    records = [{"prompt": f"Say {i}."} for i in range(3)] + [huge]
    path = write_prompts(tmp_path / "P.jsonl", records)
    wf = make_workflow({"P": {"path": str(path), "format": "prompt"}})
    wf.run("results/responses/P.jsonl")

    [error] = [json.loads(line) for line in wf.path("results/responses/P.errors.jsonl").open()]
    assert re.fullmatch(r"turn 1: prompt has \d+ tokens; the model context is 512", error["error"])
    stats = wf.stats("P")
    assert (stats["prompts"], stats["in_output"], stats["failed"]) == (4, 3, 1)
    assert all("word word" not in json.dumps(r) for r in wf.responses("P"))
    log = wf.path("logs/generate/P.log").read_text()
    assert "accounting: 4 prompts = 3 in output + 1 failed + 0 beyond limits" in log


BAD_CONFIGS = [
    ("negative budget", {"A1": {"token_budget": -5}}, "-5 is less than the minimum of 0"),
    ("unknown key", {"A1": {"budget": 5}}, "Additional properties are not allowed ('budget'"),
    ("wrong type", {"A1": {"max_samples": "ten"}}, "'ten' does not match"),
    ("unknown format", {"A1": {"format": "csv"}}, "'csv' is not one of"),
    ("missing dataset file", {"A1": {"path": "nowhere.jsonl"}}, "datasets.A1.path: nowhere"),
    ("missing model", {"model": {"path": "no/such/model"}}, "model.path: no/such/model is not"),
]


@pytest.mark.parametrize(
    ("case", "change", "message"), BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS]
)
def test_bad_config_fails_before_any_job(make_workflow, tmp_path, case, change, message) -> None:
    prompts = write_prompts(tmp_path / "A1.jsonl", sharegpt_prompts(3))
    wf = make_workflow({"A1": {"path": str(prompts), "format": "sharegpt"}})
    if "model" in change:
        wf.config["model"].update(change["model"])
    else:
        wf.config["datasets"]["A1"].update(change["A1"])
    wf.write_config()
    proc = wf.run("-n", check=False)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not wf.path("results").exists()


def _fake_server() -> Any:
    from support.fake_openai import FakeOpenAIServer

    # 4 slots at 100 tokens/s and ~20 tokens per answer: ~20 requests/s, a run of seconds.
    return FakeOpenAIServer(model="tiny", slots=4, tokens_per_s=100, mean_tokens=20)


def _http(server: Any) -> dict[str, Any]:
    return {
        "generation": {
            "backend": "openai",
            "endpoints": [server.url],
            "served_model": "tiny",
            "concurrency": 8,
        }
    }


@pytest.fixture(scope="module")
def uninterrupted_http(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Workflow:
    """The responses the killed HTTP generations must end with, from a server of the same
    settings, not killed (one run for both signals; the fake answers each conversation the
    same way whichever instance, port or attempt: support/fake_openai.py)."""
    base = tmp_path_factory.mktemp("uninterrupted-http")
    prompts = write_prompts(base / "A1.jsonl", sharegpt_prompts(80))
    datasets = {"A1": {"path": str(prompts), "format": "sharegpt", "token_budget": 1500}}
    with _fake_server() as server:
        reference = new_workflow(base, tiny_model_dir, datasets, **_http(server))
        reference.run("results/responses/A1.jsonl")
    return reference


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_killed_http_generation_resumes_without_loss_or_duplicates(
    make_workflow, uninterrupted_http: Workflow, sig
) -> None:
    datasets = copy.deepcopy(uninterrupted_http.config["datasets"])
    with _fake_server() as server:
        wf = make_workflow(datasets, name="killed", **_http(server))
        partial = wf.kill_and_resume("results/responses/A1.jsonl", sig, after_records=10)
        completed_twice = [k for k, n in server.completed_per_conversation().items() if n > 1]
    wf.assert_resumed("A1", partial, uninterrupted_http)
    # Only requests in flight at the kill (at most `concurrency`) can be answered again.
    assert len(completed_twice) <= 8


def test_a_zero_budget_gives_empty_but_complete_outputs(make_workflow, tmp_path) -> None:
    prompts = write_prompts(tmp_path / "A1.jsonl", sharegpt_prompts(5))
    wf = make_workflow({"A1": {"path": str(prompts), "format": "sharegpt", "token_budget": 0}})
    wf.run()
    assert wf.responses("A1") == []
    assert wf.stats("A1")["beyond_limits"] == 5
    manifest = json.loads(wf.path("results/hidden_states/A1/manifest.json").read_text())
    assert manifest["num_shards"] == manifest["num_samples"] == 0
    assert wf.plans_nothing()


def _hidden_state_line(out: str, dataset: str) -> str:
    return next(x for x in out.splitlines() if x.startswith(f"  {dataset}: ") and " x " in x)


def _dry_run_output(wf: Workflow) -> str:
    proc = wf.run("-n")
    return proc.stdout + proc.stderr


def test_dry_run_prints_the_hidden_state_estimate(generated: Workflow) -> None:
    wf = generated
    per_token = (3 * 64 + 64) * 2 + 5  # tiny model: H=64, bfloat16, int32 id + uint8 mask
    out = _dry_run_output(wf)
    n = len(wf.responses("A1"))
    line = _hidden_state_line(out, "A1")
    assert f"A1: {n} conversations, about " in line and f"x {per_token} B" in line, line
    tokens = wf.stats("A1")["completion_tokens"]
    assert f"  A1: done: {tokens} completion tokens in {n} conversations (limits: 100 " in out
    assert line.endswith("(decided)")
    estimate = int(line.split("about ")[1].split(" tokens")[0])
    assert "B2: unknown until something is generated (no token_budget)" in out
    assert "total: " in out and "free on results" in out

    wf.run("results/tokenized/A1.parquet")
    actual = pl.read_parquet(wf.path("results/tokenized/A1.parquet"))["num_tokens"].sum()
    # Engine counts vs the final render: ChatML adds one "\n" after each <|im_end|>.
    assert abs(estimate - actual) <= 0.05 * actual, (estimate, actual)

    wf.config["datasets"]["A1"]["token_budget"] = 400
    wf.write_config()
    line = _hidden_state_line(_dry_run_output(wf), "A1")
    assert line.endswith("(extrapolated)"), line
    assert int(line.split("about ")[1].split(" tokens")[0]) > 2 * estimate
