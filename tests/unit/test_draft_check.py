"""The draft check's metrics, split, shift control and norm inversion, on hand-made inputs."""

from __future__ import annotations

import pytest
import torch

from eagle3data.consumers.draft_check import (
    DraftCheckSettings,
    Sample,
    VariantResult,
    chain_metrics,
    margins,
    shift_states,
    split_conversations,
    summarize,
)
from eagle3data.hidden_states.final_state import PlainRmsNorm


def test_chain_metrics_counts_consecutive_accepted_steps() -> None:
    # Sequence x0..x5; step k+1 at t proposes tokens[t + 1 + k].
    tokens = torch.tensor([10, 11, 12, 13, 14, 15])
    supervised = torch.tensor([0, 1, 1, 1, 1, 1]).bool()
    proposals = torch.tensor(
        [
            # t=0      t=1  t=2  t=3  t=4  t=5
            [11, 12, 99, 14, 15, 7],  # step 1: right at t=0, 1, 3, 4
            [12, 99, 14, 15, 7, 7],  # step 2: right at t=0, 2, 3 (t=4: past the end)
            [13, 14, 15, 7, 7, 7],  # step 3: right at t=0, 1, 2
        ]
    )
    m = chain_metrics(proposals, tokens, supervised)
    # Starts: t with supervised[t+1] -> t = 0..4 (t=5 has nothing to propose).
    assert m["starts"] == 5
    # Chains: t0 3, t1 1 (step 2 wrong), t2 0 (step 1 wrong), t3 2, t4 1 (step 2 past the end).
    assert m["accepted"] == 3 + 1 + 0 + 2 + 1
    assert m["accepted_step1"] == 4
    assert m["accepted_step2"] == 2
    assert m["accepted_step3"] == 1
    s = summarize(m, 3)
    assert s["step1_agreement"] == pytest.approx(4 / 5)
    assert s["acceptance_length"] == pytest.approx(7 / 5)
    assert s["step3_chain"] == pytest.approx(1 / 5)


def test_chain_stops_at_an_unsupervised_token_and_starts_only_on_supervised() -> None:
    tokens = torch.tensor([1, 2, 3, 4, 5])
    supervised = torch.tensor([0, 1, 1, 0, 1]).bool()  # x3 is a prompt token
    proposals = torch.tensor([[*tokens[1:].tolist(), 0], [*tokens[2:].tolist(), 0, 0]])
    m = chain_metrics(proposals, tokens, supervised)
    # Starts t=0 (x1), t=1 (x2), t=3 (x4); t=2 proposes the prompt token x3.
    assert m["starts"] == 3
    # t0: x1, x2 right -> 2; t1: x2 right, x3 unsupervised -> 1; t3: x4 right, past end -> 1.
    assert m["accepted"] == 4
    assert summarize(m, 2)["acceptance_length"] == pytest.approx(4 / 3)


def test_chain_metrics_sum_over_sequences_and_refuse_bad_shapes() -> None:
    tokens = torch.tensor([1, 2, 3])
    sup = torch.ones(3, dtype=torch.bool)
    wrong = torch.zeros(2, 3, dtype=torch.long)
    m = chain_metrics(wrong, tokens, sup)
    assert m["starts"] == 2 and m["accepted"] == 0
    with pytest.raises(ValueError):
        chain_metrics(torch.zeros(2, 4, dtype=torch.long), tokens, sup)
    with pytest.raises(ValueError, match="no start"):
        summarize({"starts": 0.0}, 2)


def test_split_is_seeded_by_id_and_holds_out_some() -> None:
    ids = [f"c{i}" for i in range(20)]
    train, held = split_conversations(ids, 0.25, seed=0)
    assert len(held) == 5 and sorted(train + held) == list(range(20))
    assert split_conversations(ids, 0.25, seed=0) == (train, held)
    assert split_conversations(ids, 0.25, seed=1)[1] != held
    # The same conversations whatever the order they come in.
    reordered = list(reversed(ids))
    _, held_r = split_conversations(reordered, 0.25, seed=0)
    assert sorted(reordered[i] for i in held_r) == sorted(ids[i] for i in held)
    assert split_conversations(["a", "b"], 0.9, seed=0)[0] != []
    with pytest.raises(ValueError):
        split_conversations(["a"], 0.5, seed=0)


def test_shift_states_moves_states_one_row_later() -> None:
    n, h = 4, 2
    aux = torch.arange(n * 3 * h, dtype=torch.float32).reshape(n, 3 * h)
    last = torch.arange(n * h, dtype=torch.float32).reshape(n, h) + 100
    s = Sample("x", torch.arange(n), torch.ones(n, dtype=torch.long), aux, last)
    shifted = shift_states(s)
    assert torch.equal(shifted.input_ids, s.input_ids)
    assert torch.equal(shifted.aux_hidden_states[1:], aux[:-1])
    assert torch.equal(shifted.last_hidden_states[1:], last[:-1])
    assert not shifted.aux_hidden_states[0].any() and not shifted.last_hidden_states[0].any()


def test_prenorm_inversion_gives_back_the_pre_and_post_norm_states() -> None:
    """The pre-norm state comes back at every scale of it, so the norm gives ``post`` back:
    ``post / w`` alone is 1% off where mean(x^2) is 46 epsilons and 9 times under one."""
    torch.manual_seed(0)
    h, eps = 16, 1e-5
    weight = torch.rand(h) + 0.5
    x = torch.randn(5, h)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    x = x * torch.tensor([[1e2], [7.0], [1.0], [(46 * eps) ** 0.5], [1e-4]])

    def rms_norm(v: torch.Tensor) -> torch.Tensor:
        return weight * v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)

    post = rms_norm(x)
    restored = PlainRmsNorm(weight, eps, "target").prenorm_of(post)
    assert torch.allclose(rms_norm(restored), post, rtol=1e-5, atol=0)
    # Where eps still shows in the norm, the scale is x's own.
    assert torch.allclose(restored[3:], x[3:], rtol=1e-4, atol=0)
    assert PlainRmsNorm(weight, 0.0, "target").prenorm_of(post).equal(post / weight)
    with pytest.raises(ValueError, match="zero weight"):
        PlainRmsNorm(torch.zeros(h), eps, "target").prenorm_of(post)


def test_margins_are_the_lead_of_the_means_and_of_the_worst_seed() -> None:
    def run(seed: int, variant: str, a: float) -> VariantResult:
        return VariantResult(seed, variant, {"step1_agreement": a, "acceptance_length": 2 * a})

    results = [
        run(0, "trained", 0.5),
        run(1, "trained", 0.4),
        run(0, "shifted", 0.1),
        run(1, "shifted", 0.15),
        run(0, "untrained", 0.0),
        run(1, "untrained", 0.01),
    ]
    m = margins(results)
    assert m["shifted.step1_agreement"]["margin"] == pytest.approx(0.325)  # 0.45 - 0.125
    assert m["shifted.step1_agreement"]["worst_margin"] == pytest.approx(0.25)  # 0.4 - 0.15
    assert m["shifted.step1_agreement"]["spread"] == pytest.approx(0.1)
    assert m["shifted.step1_agreement"]["control_spread"] == pytest.approx(0.05)
    assert m["untrained.acceptance_length"]["margin"] == pytest.approx(0.89)  # 0.9 - 0.01
    assert m["untrained.acceptance_length"]["worst_margin"] == pytest.approx(0.78)


def test_settings_refuse_nonsense_and_ignore_rule_keys() -> None:
    s = DraftCheckSettings.from_config({"enabled": True, "threads": 2, "seeds": [3], "epochs": 2})
    assert s.seeds == (3,) and s.epochs == 2
    with pytest.raises(ValueError):
        DraftCheckSettings(heldout_fraction=1.0)
    with pytest.raises(ValueError):
        DraftCheckSettings(seeds=())
