"""Budget semantics: ``select_prefix`` and ``plan_dispatch`` (pure functions)."""

from __future__ import annotations

import random

import pytest

from eagle3data.generation.budget import Outcome, Selection, plan_dispatch, select_prefix


def ok(tokens: int) -> Outcome:
    return Outcome(tokens)


FAIL = Outcome(0, failed=True)


def ids(n: int) -> list[str]:
    return [f"p{i}" for i in range(n)]


def outcomes_of(tokens: list[int | None]) -> dict[str, Outcome]:
    """Outcomes for ``ids(len(tokens))``: an int is a completion, None is a failure."""
    return {f"p{i}": FAIL if t is None else ok(t) for i, t in enumerate(tokens)}


# --------------------------------------------------------------------------- select_prefix


def test_no_limits_selects_everything():
    order = ids(4)
    sel = select_prefix(order, outcomes_of([5, 7, 1, 3]), token_budget=None, max_samples=None)
    assert sel.selected == [0, 1, 2, 3]
    assert sel.failed == []
    assert sel.tokens == 16
    assert sel.complete
    assert sel.stop_reason == "exhausted"
    assert sel.frontier == 4


def test_empty_order_is_complete():
    sel = select_prefix([], {}, token_budget=10, max_samples=10)
    assert sel.complete
    assert sel.selected == []
    assert sel.tokens == 0
    assert sel.frontier == 0


def test_prefix_never_exceeds_budget_and_is_longest():
    order = ids(5)
    sel = select_prefix(order, outcomes_of([4, 4, 4, 4, 4]), token_budget=10, max_samples=None)
    assert sel.selected == [0, 1]
    assert sel.tokens == 8
    assert sel.complete
    assert sel.stop_reason == "token_budget"
    assert sel.frontier == 2


def test_stops_at_first_prompt_that_would_exceed_even_if_later_fits():
    # p1 (50) does not fit; p2 (1) would, but the output is a PREFIX.
    order = ids(3)
    sel = select_prefix(order, outcomes_of([5, 50, 1]), token_budget=10, max_samples=None)
    assert sel.selected == [0]
    assert sel.tokens == 5
    assert sel.complete
    assert sel.stop_reason == "token_budget"
    assert sel.frontier == 1


def test_exactly_at_budget_is_complete_without_the_next_prompt():
    # p2 is unknown, but every completion costs >= 1 token, so the prefix is final.
    order = ids(3)
    outcomes = {"p0": ok(6), "p1": ok(4)}
    sel = select_prefix(order, outcomes, token_budget=10, max_samples=None)
    assert sel.selected == [0, 1]
    assert sel.tokens == 10
    assert sel.complete
    assert sel.stop_reason == "token_budget"
    assert sel.frontier == 2


def test_exactly_at_budget_on_last_prompt():
    sel = select_prefix(ids(2), outcomes_of([6, 4]), token_budget=10, max_samples=None)
    assert sel.selected == [0, 1]
    assert sel.tokens == 10
    assert sel.complete


def test_failed_prompts_are_skipped_inside_the_prefix_and_listed():
    order = ids(5)
    sel = select_prefix(
        order, outcomes_of([3, None, 3, None, 3]), token_budget=None, max_samples=None
    )
    assert sel.selected == [0, 2, 4]
    assert sel.failed == [1, 3]
    assert sel.tokens == 9
    assert sel.complete


def test_failed_prompts_beyond_the_prefix_are_not_listed():
    order = ids(4)
    sel = select_prefix(order, outcomes_of([5, 5, None, 5]), token_budget=10, max_samples=None)
    assert sel.selected == [0, 1]
    assert sel.failed == []  # p2 lies beyond the decided prefix
    assert sel.frontier == 2


def test_failed_prompts_do_not_count_towards_max_samples():
    order = ids(5)
    sel = select_prefix(order, outcomes_of([1, None, 1, None, 1]), token_budget=None, max_samples=2)
    assert sel.selected == [0, 2]
    assert sel.failed == [1]
    assert sel.stop_reason == "max_samples"
    assert sel.frontier == 3


def test_max_samples_only():
    order = ids(5)
    sel = select_prefix(order, outcomes_of([100] * 5), token_budget=None, max_samples=3)
    assert sel.selected == [0, 1, 2]
    assert sel.tokens == 300
    assert sel.complete
    assert sel.stop_reason == "max_samples"
    assert sel.frontier == 3


def test_max_samples_reached_does_not_need_the_next_record():
    sel = select_prefix(ids(5), {"p0": ok(1), "p1": ok(1)}, token_budget=None, max_samples=2)
    assert sel.complete
    assert sel.selected == [0, 1]


def test_both_limits_token_budget_binds():
    sel = select_prefix(ids(6), outcomes_of([4] * 6), token_budget=10, max_samples=5)
    assert sel.selected == [0, 1]
    assert sel.stop_reason == "token_budget"


def test_both_limits_max_samples_binds():
    sel = select_prefix(ids(6), outcomes_of([4] * 6), token_budget=100, max_samples=2)
    assert sel.selected == [0, 1]
    assert sel.stop_reason == "max_samples"


def test_budget_zero_selects_nothing_and_needs_no_records():
    sel = select_prefix(ids(3), {}, token_budget=0, max_samples=None)
    assert sel.complete
    assert sel.selected == []
    assert sel.tokens == 0
    assert sel.frontier == 0
    assert sel.stop_reason == "token_budget"


def test_max_samples_zero_selects_nothing_and_needs_no_records():
    sel = select_prefix(ids(3), {}, token_budget=None, max_samples=0)
    assert sel.complete
    assert sel.selected == []
    assert sel.frontier == 0
    assert sel.stop_reason == "max_samples"


def test_incomplete_when_a_record_is_missing_frontier_at_first_missing():
    order = ids(5)
    outcomes = {"p0": ok(1), "p1": FAIL, "p3": ok(1), "p4": ok(1)}  # p2 missing
    sel = select_prefix(order, outcomes, token_budget=100, max_samples=None)
    assert not sel.complete
    assert sel.stop_reason is None
    assert sel.frontier == 2
    assert sel.selected == [0]
    assert sel.failed == [1]
    assert sel.tokens == 1


def test_incomplete_with_nothing_known():
    sel = select_prefix(ids(3), {}, token_budget=10, max_samples=None)
    assert not sel.complete
    assert sel.frontier == 0
    assert sel.selected == []


def test_missing_record_after_the_stop_point_does_not_matter():
    # p1 would exceed, p2 is unknown: the prefix is decided.
    sel = select_prefix(ids(3), {"p0": ok(5), "p1": ok(50)}, token_budget=10, max_samples=None)
    assert sel.complete
    assert sel.selected == [0]


def test_outcomes_for_ids_not_in_order_are_ignored():
    outcomes = outcomes_of([1, 1]) | {"stranger": ok(1000)}
    sel = select_prefix(ids(2), outcomes, token_budget=5, max_samples=None)
    assert sel.selected == [0, 1]
    assert sel.tokens == 2


# --------------------------------------------------------------------------- plan_dispatch


def plan(order, outcomes, *, token_budget=None, max_samples=None, expected=10.0, limit=100):
    sel = select_prefix(order, outcomes, token_budget=token_budget, max_samples=max_samples)
    return plan_dispatch(
        order,
        outcomes,
        sel,
        token_budget=token_budget,
        max_samples=max_samples,
        expected_tokens=expected,
        limit=limit,
    )


def test_plan_returns_nothing_when_complete():
    assert plan(ids(3), outcomes_of([1, 1, 1])) == []
    assert plan(ids(3), {}, token_budget=0) == []
    assert plan(ids(3), {}, max_samples=0) == []
    assert plan(ids(3), {"p0": ok(10)}, token_budget=10) == []


def test_plan_respects_limit_and_starts_at_frontier():
    order = ids(10)
    assert plan(order, {}, limit=3) == [0, 1, 2]
    assert plan(order, {"p0": ok(1), "p1": ok(1)}, limit=4) == [2, 3, 4, 5]
    assert plan(order, {}, limit=1) == [0]


def test_plan_without_limits_dispatches_up_to_limit():
    assert plan(ids(3), {}, limit=8) == [0, 1, 2]


def test_plan_always_includes_first_missing_even_if_expected_exceeds_budget():
    # Committed 9 of 10; expected 1000 per prompt: still dispatch one to make progress.
    order = ids(4)
    batch = plan(order, {"p0": ok(9)}, token_budget=10, expected=1000.0)
    assert batch == [1]


def test_plan_stops_when_committed_plus_expected_reaches_budget():
    order = ids(10)
    # committed 0; expected 10 each; budget 35 -> 10, 20, 30 (< 35), 40 (>= 35) then stop
    assert plan(order, {}, token_budget=35, expected=10.0) == [0, 1, 2, 3]
    # exactly reaching: 10, 20, 30 -> reaches 30, stop
    assert plan(order, {}, token_budget=30, expected=10.0) == [0, 1, 2]
    # committed tokens count: p0 = 15 committed, then 25, 35 (>= 30) stop
    assert plan(order, {"p0": ok(15)}, token_budget=30, expected=10.0) == [1, 2]


def test_plan_counts_known_later_records_exactly():
    order = ids(6)
    outcomes = {"p1": ok(50), "p3": ok(1)}
    # p0 unknown:30, p1 known:+50=80, p2 unknown:+30=110 -> reached, stop
    assert plan(order, outcomes, token_budget=100, expected=30.0) == [0, 2]
    # a small known record is counted as small, not at the expectation
    outcomes = {"p1": ok(1), "p2": ok(1)}
    # p0:30, p1:31, p2:32, p3:62, p4:92, p5:122
    assert plan(order, outcomes, token_budget=100, expected=30.0) == [0, 3, 4, 5]


def test_plan_skips_known_failed_records():
    order = ids(5)
    outcomes = {"p1": FAIL, "p2": FAIL}
    assert plan(order, outcomes, token_budget=25, expected=10.0) == [0, 3, 4]
    # with max_samples, failures do not take a sample slot
    assert plan(order, outcomes, max_samples=2, expected=10.0) == [0, 3]


def test_plan_respects_max_samples_counting_known_records():
    order = ids(6)
    assert plan(order, {}, max_samples=3) == [0, 1, 2]
    # p0 known and selected; p2 known later counts as a sample too
    assert plan(order, {"p0": ok(1), "p2": ok(1)}, max_samples=4) == [1, 3]


def test_plan_positions_are_missing_ascending_and_within_limit():
    order = ids(8)
    outcomes = {"p0": ok(1), "p2": ok(2), "p5": FAIL}
    batch = plan(order, outcomes, limit=3)
    assert batch == [1, 3, 4]
    assert all(order[p] not in outcomes for p in batch)


def test_plan_from_an_incomplete_hand_built_selection():
    # A Selection passed in explicitly: the plan starts at its frontier.
    order = ids(4)
    sel = Selection(selected=[0], tokens=5, complete=False, frontier=1)
    batch = plan_dispatch(
        order,
        {"p0": ok(5)},
        sel,
        token_budget=20,
        max_samples=None,
        expected_tokens=5.0,
        limit=10,
    )
    assert batch == [1, 2, 3]  # 10, 15, 20 -> reached


# --------------------------------------------------------------------------- properties


def _reference_prefix(tokens, token_budget, max_samples):
    """Brute force: the longest prefix (skipping failures) within both limits."""
    best_end = 0
    for end in range(len(tokens) + 1):
        head = tokens[:end]
        ok_tokens = [t for t in head if t is not None]
        if token_budget is not None and sum(ok_tokens) > token_budget:
            break
        if max_samples is not None and len(ok_tokens) > max_samples:
            break
        best_end = end
    return [i for i in range(best_end) if tokens[i] is not None]


def _random_case(rng: random.Random):
    n = rng.randint(0, 25)
    tokens = [None if rng.random() < 0.15 else rng.randint(1, 40) for _ in range(n)]
    token_budget = rng.choice([None, 0, rng.randint(0, 400), rng.randint(0, 60)])
    max_samples = rng.choice([None, None, 0, rng.randint(0, 30)])
    return tokens, token_budget, max_samples


def test_property_selection_is_within_limits_and_maximal():
    rng = random.Random(20240517)
    for _ in range(3000):
        tokens, token_budget, max_samples = _random_case(rng)
        order = ids(len(tokens))
        outcomes = outcomes_of(tokens)
        sel = select_prefix(order, outcomes, token_budget=token_budget, max_samples=max_samples)
        ctx = (tokens, token_budget, max_samples, sel)
        assert sel.complete, ctx
        assert sel.tokens == sum(tokens[i] for i in sel.selected), ctx
        if token_budget is not None:
            assert sel.tokens <= token_budget, ctx
        if max_samples is not None:
            assert len(sel.selected) <= max_samples, ctx
        # selected + failed partition exactly the positions before the frontier
        assert sorted(sel.selected + sel.failed) == list(range(sel.frontier)), ctx
        assert all(tokens[i] is None for i in sel.failed), ctx
        # maximal: the next non-failed prompt would break a limit, or there is none
        nxt = next((i for i in range(sel.frontier, len(tokens)) if tokens[i] is not None), None)
        if nxt is not None:
            over_budget = token_budget is not None and sel.tokens + tokens[nxt] > token_budget
            at_max = max_samples is not None and len(sel.selected) >= max_samples
            assert over_budget or at_max, ctx
        assert sel.selected == _reference_prefix(tokens, token_budget, max_samples), ctx


def test_property_partial_knowledge_never_contradicts_the_final_selection():
    """With some records missing, a complete selection equals the full-knowledge one,
    and an incomplete one is a prefix of it whose frontier is a missing prompt."""
    rng = random.Random(7)
    for _ in range(3000):
        tokens, token_budget, max_samples = _random_case(rng)
        order = ids(len(tokens))
        full = outcomes_of(tokens)
        final = select_prefix(order, full, token_budget=token_budget, max_samples=max_samples)
        known = {k: v for k, v in full.items() if rng.random() < 0.7}
        sel = select_prefix(order, known, token_budget=token_budget, max_samples=max_samples)
        ctx = (tokens, token_budget, max_samples, sorted(known), sel, final)
        if sel.complete:
            assert sel.selected == final.selected, ctx
            assert sel.failed == final.failed, ctx
            assert sel.tokens == final.tokens, ctx
        else:
            assert order[sel.frontier] not in known, ctx
            assert all(order[i] in known for i in range(sel.frontier)), ctx
            assert final.selected[: len(sel.selected)] == sel.selected, ctx
            assert final.frontier >= sel.frontier, ctx


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_property_plan_dispatch(seed):
    rng = random.Random(seed)
    for _ in range(1500):
        tokens, token_budget, max_samples = _random_case(rng)
        order = ids(len(tokens))
        full = outcomes_of(tokens)
        known = {k: v for k, v in full.items() if rng.random() < 0.5}
        limit = rng.randint(1, 6)
        expected = float(rng.randint(1, 40))
        sel = select_prefix(order, known, token_budget=token_budget, max_samples=max_samples)
        batch = plan_dispatch(
            order,
            known,
            sel,
            token_budget=token_budget,
            max_samples=max_samples,
            expected_tokens=expected,
            limit=limit,
        )
        ctx = (tokens, token_budget, max_samples, sorted(known), limit, expected, batch)
        if sel.complete:
            assert batch == [], ctx
            continue
        assert batch, ctx
        assert batch[0] == sel.frontier, ctx
        assert len(batch) <= limit, ctx
        assert batch == sorted(set(batch)), ctx
        assert all(order[p] not in known for p in batch), ctx
        # Everything dispatched except the first was still within the limits when added:
        # committed + expected tokens of everything before it stayed below the budget.
        for j, pos in enumerate(batch[1:], start=1):
            before = [p for p in range(sel.frontier, pos)]
            est = sel.tokens
            n = len(sel.selected)
            for p in before:
                o = known.get(order[p])
                if o is None:
                    est += expected
                    n += 1
                elif not o.failed:
                    est += o.completion_tokens
                    n += 1
            if token_budget is not None:
                assert est < token_budget, (ctx, j)
            if max_samples is not None:
                assert n < max_samples, (ctx, j)


def test_property_dispatch_loop_converges_to_the_final_selection():
    """Simulate the driver: plan, 'generate' the batch, re-select, until complete."""
    rng = random.Random(99)
    for _ in range(500):
        tokens, token_budget, max_samples = _random_case(rng)
        order = ids(len(tokens))
        full = outcomes_of(tokens)
        final = select_prefix(order, full, token_budget=token_budget, max_samples=max_samples)
        known: dict[str, Outcome] = {}
        limits = {"token_budget": token_budget, "max_samples": max_samples}
        sel = select_prefix(order, known, **limits)
        rounds = 0
        while not sel.complete:
            batch = plan_dispatch(
                order, known, sel, expected_tokens=10.0, limit=rng.randint(1, 5), **limits
            )
            assert batch
            for p in batch:
                known[order[p]] = full[order[p]]
            sel = select_prefix(order, known, **limits)
            rounds += 1
            assert rounds <= len(order) + 1
        assert sel.selected == final.selected
        assert sel.failed == final.failed


def test_array_selection_equals_the_reference_selection():
    import numpy as np

    from eagle3data.generation.budget import select_prefix_arrays

    rng = random.Random(20261130)
    for _ in range(5000):
        tokens, token_budget, max_samples = _random_case(rng)
        order = ids(len(tokens))
        outcomes = outcomes_of(tokens)
        # Leave some prompts unknown (not generated yet) to cover undecided prefixes.
        unknown = {pid for pid in order if rng.random() < 0.1}
        known_outcomes = {k: v for k, v in outcomes.items() if k not in unknown}
        want = select_prefix(
            order, known_outcomes, token_budget=token_budget, max_samples=max_samples
        )
        known = np.array([pid in known_outcomes for pid in order], dtype=bool)
        failed = np.array([t is None for t in tokens], dtype=bool) & known
        completion = np.array([t or 0 for t in tokens], dtype=np.int64)
        got = select_prefix_arrays(
            known, failed, completion, token_budget=token_budget, max_samples=max_samples
        )
        assert got == want, (tokens, sorted(unknown), token_budget, max_samples)
