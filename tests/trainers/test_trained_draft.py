"""A draft trained on real target states beats both controls (speculators' own model and loss).

The states are the real demo model's (SmolLM2-135M): 40 short chat conversations answered
greedily by the model, the aux layers and the post-norm final state taken as the workflow
takes them (``output_hidden_states`` [2, 15, 27], the last entry), the target's answer
supervised. speculators' ``Eagle3DraftModel`` (1 layer, sdpa, eager KL loss) trains on 30 and
is measured on the 10 held out (``run_draft_check``), for three seeds. The trained draft must
beat every seed of each control (its worst seed against the control's best) by more than
:data:`MARGIN` and more than the control's seed-to-seed spread. The same criterion fails
for the draft trained on states shifted one position against
the untrained draft: states that do not line up with their tokens fail this test. The aux
control (each position's aux states replaced by another's) is not trained here: on 30
conversations the trained draft's lead over it is below the seed spread, so nothing could be
asserted of it (BENCHMARKS.md measures it on the demo's shards with ``bench_draft_check.py``;
the draft_check rule's test below trains it).
(The workflow's 6-conversation fixture of ``tests/trainers/conftest.py`` holds out too few
positions for a margin that clears the noise.)
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

pytest.importorskip("speculators", reason="the README's test command installs speculators==0.9.0")

from support.exported_run import ExportedRun
from support.workers import worker_threads

from eagle3data.consumers.draft_check import (
    DraftCheckSettings,
    Sample,
    VariantResult,
    margins,
    run_draft_check,
)
from eagle3data.consumers.vocab import draft_vocab

pytestmark = pytest.mark.e2e

AUX = [2, 15, 27]  # the workflow's default for 30 layers (output_hidden_states indices)
MARGIN = 0.1  # step-1 agreement; acceptance length (out of 3) gets the same absolute margin
SETTINGS = DraftCheckSettings(seeds=(0, 1, 2), epochs=10, lr=3e-3, batch_tokens=256)
COLORS = ["red", "blue", "green", "yellow", "black", "white", "pink", "brown"]
HOW_MANY = ["one thing that is", "two things that are", "three things that are"]
HOW_MANY += ["four things that are", "five things that are"]


def _prompts() -> list[str]:
    out = []
    for i in range(40):
        a, b = 3 + i, 7 + 2 * i
        # 40 distinct prompts: the check splits by prompt, and a repeated prompt (the same
        # greedy answer) would be one conversation, held out or trained on as a whole.
        k = i // 2
        out.append(
            f"What is {a} plus {b}?" if i % 2 else f"Name {HOW_MANY[k // 4]} {COLORS[k % 8]}."
        )
    return out


def _target_samples(model_dir: Path) -> list[Sample]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok.padding_side = "left"
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in _prompts()
    ]
    batch = tok(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=32, do_sample=False)
    samples = []
    width = batch["input_ids"].shape[1]
    for i in range(len(texts)):
        prompt = batch["input_ids"][i][batch["attention_mask"][i].bool()]
        answer = out[i, width:].tolist()
        if tok.eos_token_id in answer:
            answer = answer[: answer.index(tok.eos_token_id) + 1]
        ids = torch.cat([prompt, torch.tensor(answer)])
        with torch.no_grad():
            states = model(ids[None], output_hidden_states=True).hidden_states
        mask = torch.zeros(len(ids), dtype=torch.long)
        mask[len(prompt) :] = 1
        samples.append(
            Sample(
                id=f"c{i:02d}",
                input_ids=ids,
                loss_mask=mask,
                aux_hidden_states=torch.cat([states[k][0] for k in AUX], dim=-1),
                last_hidden_states=states[-1][0],  # after the final norm
            )
        )
    return samples


# The variants this test asserts on (the aux control's three trainings would be a third of
# its time, for a figure it only printed).
VARIANTS = ("trained", "shifted", "untrained")


def _passes(summary_margins: dict[str, dict[str, float]], control: str) -> bool:
    found = {k: m for k, m in summary_margins.items() if k.startswith(f"{control}.")}
    assert len(found) == 2, (control, summary_margins)  # both metrics measured
    return all(m["worst_margin"] > max(MARGIN, m["control_spread"]) for m in found.values())


def test_trained_draft_beats_shifted_and_untrained_controls(smollm2_dir: Path) -> None:
    torch.set_num_threads(worker_threads())
    start = time.monotonic()
    samples = _target_samples(smollm2_dir)
    counts = Counter(int(t) for s in samples for t in s.input_ids[s.loss_mask.bool()])
    vocab = draft_vocab(counts, 256, 49152)  # SmolLM2's vocab_size
    generated = time.monotonic() - start
    summary = run_draft_check(
        samples, smollm2_dir, {"d2t": vocab.d2t, "t2d": vocab.t2d}, AUX, SETTINGS, VARIANTS
    )
    elapsed = time.monotonic() - start
    got = summary["margins"]
    report = {k: (round(v["margin"], 4), round(v["spread"], 4)) for k, v in got.items()}
    means = {v: round(a["step1_agreement"]["mean"], 4) for v, a in summary["aggregate"].items()}
    print(f"draft check: data {generated:.0f} s, all {elapsed:.0f} s, step-1 {means}, {report}")
    assert summary["conversations"] == {"train": 30, "heldout": 10}
    assert set(summary["aggregate"]) == set(VARIANTS)
    assert _passes(got, "shifted"), report
    assert _passes(got, "untrained"), report

    # The criterion can fail: the draft trained on shifted states does not pass it against
    # the untrained draft.
    runs = [
        VariantResult(
            r["seed"], "trained" if r["variant"] == "shifted" else r["variant"], r["metrics"]
        )
        for r in summary["runs"]
        if r["variant"] != "trained"
    ]
    broken = margins(runs)
    assert not _passes(broken, "untrained"), broken


def test_the_draft_check_rule_runs_on_the_workflows_shards(exported_run: ExportedRun) -> None:
    """Off by default; enabled, the rule writes every variant's figures for every seed."""
    wf = exported_run.workflow
    assert "draft_check" not in wf.run("-n").stdout
    config = dict(wf.config)
    wf.config = {**config, "draft_check": {"enabled": True, "seeds": [0], "epochs": 1}}
    wf.write_config()
    try:
        wf.run("results/draft_check/summary.json", timeout=600)
        summary = json.loads(wf.path("results/draft_check/summary.json").read_text())
        assert set(summary["aggregate"]) == {"trained", "aux_shuffled", "shifted", "untrained"}
        assert {key.split(".")[0] for key in summary["margins"]} == {
            "aux_shuffled",
            "shifted",
            "untrained",
        }
        assert summary["criterion"]["passed"] is False  # one seed measures no spread
        assert wf.path("logs/draft_check/draft_check.log").read_text().strip()
        assert wf.plans_nothing()
    finally:
        wf.config = config
        wf.write_config()
