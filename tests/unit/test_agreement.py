"""The agreement check's parts: positions, template tails, chunked scoring, the head, the
judgement, the aux-layer rule and the mask comparison (the real model: tests/integration/
test_agreement_links.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from eagle3data.errors import ValidationError
from eagle3data.hidden_states import agreement
from eagle3data.hidden_states.layers import resolve_aux_layers
from eagle3data.hidden_states.validation import _mask_difference, aux_layer_errors
from eagle3data.tokenization.settings import TokenizeSettings

EOT = 2


def test_produced_positions_skip_prompt_template_and_sample_ends():
    # sample 0: prompt 5 6, produced 7 8 EOT, template "\n" (10) supervised after EOT
    # sample 1: prompt 5, produced 9 EOT
    ids = np.array([5, 6, 7, 8, EOT, 10, 5, 9, EOT])
    mask = np.array([0, 0, 1, 1, 1, 1, 0, 1, 1])
    offsets = np.array([0, 6, 9])
    got = agreement.produced_positions(ids, mask, offsets, {EOT})
    # t predicts t + 1: 1->7, 2->8, 3->EOT; not 4->10 (after EOT); not 5->5 (next
    # sample); 6->9, 7->EOT.
    assert got.tolist() == [1, 2, 3, 6, 7]


def test_template_tails_of_a_truncated_turn_are_not_produced():
    # whole conversation, two turns: the first stopped by itself, the second cut at
    # max_tokens 2 and closed by the template with two tokens.
    mask = np.array([0, 1, 1, 1, 0, 1, 1, 1, 1])
    offsets = np.array([0, 9])
    turns = {
        "r": [
            agreement.TurnRecord(1, 3, truncated=False),
            agreement.TurnRecord(3, 2, truncated=True),
        ]
    }
    tails = agreement.template_tails(mask, offsets, ["r"], turns)
    assert np.flatnonzero(tails).tolist() == [7, 8]
    # A per-turn sample names its turn by message index.
    per_turn = agreement.template_tails(mask[4:], np.array([0, 5]), ["r#3"], turns)
    assert np.flatnonzero(per_turn).tolist() == [3, 4]
    ids = np.arange(9) + 100
    got = agreement.produced_positions(ids, mask, offsets, set(), tails)
    assert got.tolist() == [0, 1, 2, 4, 5]


def test_turn_records_follow_the_assistant_messages():
    record = {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d"},
        ],
        "turns": [
            {"completion_tokens": 4, "finish_reason": "stop"},
            {"completion_tokens": 9, "finish_reason": "length"},
        ],
    }
    assert agreement.turn_records(record) == [
        agreement.TurnRecord(1, 4, False),
        agreement.TurnRecord(3, 9, True),
    ]
    assert agreement.turn_records({**record, "turns": []}) == []


def test_chunked_scores_equal_a_full_log_softmax(monkeypatch):
    monkeypatch.setattr(agreement, "_VOCAB_CHUNK", 7)
    gen = torch.Generator().manual_seed(0)
    head = torch.randn(30, 8, generator=gen)
    states = torch.randn(5, 8, generator=gen)
    targets = torch.tensor([0, 6, 7, 29, 13])
    controls = torch.tensor([1, -1, 28, 3, 13])
    agree, logprob, c_agree, c_logprob = agreement.score(states, targets, controls, head)
    full = torch.log_softmax(states @ head.T, dim=1)
    assert torch.equal(agree, full.argmax(1) == targets)
    assert torch.allclose(logprob, full[torch.arange(5), targets], atol=1e-5)
    has = controls >= 0
    assert torch.equal(c_agree[has], (full.argmax(1) == controls)[has])
    assert torch.allclose(c_logprob[has], full[torch.arange(5)[has], controls[has]], atol=1e-5)


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (["model.embed_tokens.weight", "lm_head.weight"], "lm_head.weight"),
        (["model.embed_tokens.weight"], "model.embed_tokens.weight"),  # tied
        (
            ["vision_tower.x.weight", "language_model.lm_head.weight"],
            "language_model.lm_head.weight",
        ),
    ],
)
def test_the_head_is_the_text_decoders(names, expected):
    assert agreement.head_tensor_name(names) == expected


def test_no_head_is_a_clear_error():
    with pytest.raises(ValidationError, match=r"no lm_head\.weight"):
        agreement.head_tensor_name(["model.norm.weight"])


def test_load_head_reads_only_the_head_from_a_sharded_checkpoint(tmp_path):
    head = torch.randn(11, 4).to(torch.bfloat16)
    save_file({"model.norm.weight": torch.ones(4)}, tmp_path / "a.safetensors")
    save_file({"lm_head.weight": head}, tmp_path / "b.safetensors")
    index = {
        "weight_map": {"model.norm.weight": "a.safetensors", "lm_head.weight": "b.safetensors"}
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert torch.equal(agreement.load_head(tmp_path), head)


def test_a_tied_model_uses_its_embedding(tiny_model_dir):
    from safetensors import safe_open

    with safe_open(tiny_model_dir / "model.safetensors", framework="pt") as f:
        embedding = f.get_tensor("model.embed_tokens.weight")
    assert torch.equal(agreement.load_head(tiny_model_dir), embedding)


def test_a_quantized_head_or_no_weights_say_how_to_skip(tmp_path):
    with pytest.raises(ValidationError, match="enabled: false"):
        agreement.load_head(tmp_path)
    save_file(
        {"lm_head.weight": torch.zeros(4, 4, dtype=torch.int8)}, tmp_path / "model.safetensors"
    )
    with pytest.raises(ValidationError, match=r"torch.int8 \[4, 4\].*enabled: false"):
        agreement.load_head(tmp_path)


def test_end_of_turn_ids_from_both_configs_and_a_wrapper(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": 9}}))
    assert agreement.end_of_turn_ids(tmp_path) == {2, 7, 9}


SUMMARY = {
    "positions": 100,
    "agreement": 0.95,
    "mean_logprob": -0.8,
    "control_positions": 98,
    "control_agreement": 0.01,
    "control_mean_logprob": -10.0,
}


def test_judgement_of_greedy_and_sampled_data():
    settings = agreement.AgreementSettings()
    assert agreement.judge(SUMMARY, greedy=True, settings=settings) == []
    assert agreement.judge(SUMMARY, greedy=False, settings=settings) == []
    low = {**SUMMARY, "agreement": 0.7}
    (problem,) = agreement.judge(low, greedy=True, settings=settings)
    assert "min_agreement 0.8" in problem
    shifted = {**SUMMARY, "agreement": 0.02, "control_agreement": 0.95}
    assert len(agreement.judge(shifted, greedy=True, settings=settings)) == 2
    flat = {**SUMMARY, "agreement": 0.5, "mean_logprob": -8.0}
    (problem,) = agreement.judge(flat, greedy=False, settings=settings)
    assert "min_logprob_margin" in problem
    message = agreement.failure_message("B2", low, [problem])
    assert message.startswith("B2: the target does not agree")
    for cause in ("tokenizer", "reasoning", "post-norm", "off by one"):
        assert cause in message
    assert agreement.judge({**SUMMARY, "positions": 0}, greedy=True, settings=settings) == []


def test_recorded_aux_layers_are_checked_against_the_rule():
    attrs = resolve_aux_layers("auto", 30).as_attrs()
    assert aux_layer_errors(attrs, "auto", "layer_output", 30) == []
    wrong = {**attrs, "aux_layer_ids": [2, 14, 26]}
    (error,) = aux_layer_errors(wrong, "auto", "layer_output", 30)
    assert "aux_layer_ids is [2, 14, 26], the config's rule gives [1, 14, 26]" in error
    # Explicit ids in the other convention mean the same layers.
    assert aux_layer_errors(attrs, [2, 15, 27], "hidden_states_index", 30) == []


def test_mask_difference_names_a_shift():
    expected = [0, 0, 1, 1, 1, 0]
    assert "shifted by +1" in _mask_difference([0, 0, 0, 1, 1, 1], expected)
    assert "shifted by -1" in _mask_difference([0, 1, 1, 1, 0, 0], expected)
    other = _mask_difference([1, 0, 1, 1, 1, 0], expected)
    assert "differs from the chat template's at 1 positions (first at token 0" in other


def test_agreement_stats_add_up():
    a = agreement.AgreementStats(10, 9, -5.0, 8, 1, -80.0)
    b = agreement.AgreementStats(10, 8, -7.0, 10, 0, -100.0)
    total = a.combine(b).summary()
    assert total["positions"] == 20 and total["agreement"] == 0.85
    assert total["control_agreement"] == round(1 / 18, 6)
    assert agreement.AgreementStats().summary()["agreement"] is None


def test_status_and_report_show_the_check_per_dataset():
    from eagle3data.monitor.report import agreement_text
    from eagle3data.monitor.snapshot import agreement_cell

    greedy = {**SUMMARY, "greedy": True}
    sampled = {**SUMMARY, "greedy": False}
    assert agreement_cell(greedy) == "0.95/0.01"
    assert agreement_cell(sampled) == "lp -0.8/-10.0"
    assert agreement_cell({"enabled": False}) == "off"
    assert agreement_cell(None) == "-"
    assert agreement_text(greedy) == "0.9500 (control 0.0100), greedy, 100 positions"
    assert agreement_text(sampled).endswith("; log-prob -0.80 (control -10.00)")
    assert agreement_text(None).startswith("not checked")


def test_a_snapshot_reads_the_agreement_from_the_manifest(tmp_path):
    from eagle3data.layout import MANIFEST, Results
    from eagle3data.monitor.snapshot import _agreement

    results = Results(tmp_path)
    assert _agreement(results, "A1") is None
    manifest = results.path(MANIFEST, dataset="A1")
    manifest.parent.mkdir(parents=True)
    check = {**SUMMARY, "greedy": True, "shards": [{"file": "shard-00000.h5"}], "settings": {}}
    manifest.write_text(json.dumps({"agreement": check}))
    assert _agreement(results, "A1") == {**SUMMARY, "greedy": True}
    manifest.write_text(json.dumps({"agreement": None}))
    assert _agreement(results, "A1") == {"enabled": False}


def test_retokenizing_a_sample_of_responses_finds_a_shifted_mask(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    from eagle3data.chat import tokenize_conversation
    from eagle3data.hidden_states.validation import retokenize_errors
    from eagle3data.shards import ShardWriter

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    conversations = [
        [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": "Paris."}]
        for i in range(5)
    ]
    responses = tmp_path / "responses.jsonl"
    responses.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "messages": c}) + "\n" for i, c in enumerate(conversations)
        )
    )
    settings = TokenizeSettings(chat_template_kwargs={}, max_seq_len=256, reasoning="keep")

    def shard(name: str, shift: int) -> str:
        path = tmp_path / name
        with ShardWriter(path, hidden_size=4, hidden_dtype="float32", attrs={}) as writer:
            for i, conversation in enumerate(conversations):
                (sample,) = tokenize_conversation(tokenizer, conversation)
                mask = ([0] * shift + sample.loss_mask)[: len(sample.loss_mask)]
                n = len(sample.input_ids)
                writer.add(f"q{i}", sample.input_ids, mask, torch.zeros(n, 12), torch.zeros(n, 4))
        return str(path)

    def check(path: str, count: int) -> list[str]:
        return retokenize_errors(
            str(responses),
            [path],
            model_path=str(tiny_model_dir),
            tokenize=settings,
            trust_remote_code=False,
            count=count,
        )

    assert check(shard("ok.h5", 0), 5) == []
    errors = check(shard("shifted.h5", 1), 3)  # a seeded sample of 3 of the 5
    assert len(errors) == 3
    assert all("shifted by +1 token(s)" in e and "responses.jsonl:" in e for e in errors)
    assert check(shard("shifted.h5", 1), 0) == []  # 0 turns it off
