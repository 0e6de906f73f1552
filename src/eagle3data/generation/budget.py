"""Budget semantics, as pure functions over (prompt order, finished records).

The final output is the longest prefix of the seeded prompt order, skipping
permanently failed prompts, whose completion tokens stay within
``token_budget`` and whose size stays within ``max_samples``. Because it is a
function of the records alone, it is the same whether or not the run was
interrupted, and raising or lowering a limit just re-selects from what exists.

Every completion is assumed to cost at least one token (the engines count the
end-of-turn token), so a prefix that has spent the whole budget is final
without generating the next prompt.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

StopReason = Literal["exhausted", "token_budget", "max_samples"]


@dataclass(frozen=True)
class Outcome:
    """What is known about one prompt: its completion tokens, or that it failed."""

    completion_tokens: int
    failed: bool = False


@dataclass(frozen=True)
class Selection:
    selected: list[int] = field(default_factory=list)  # positions in the order
    failed: list[int] = field(default_factory=list)  # failed positions inside the prefix
    tokens: int = 0
    complete: bool = False
    stop_reason: StopReason | None = None
    frontier: int = 0  # first position not decided yet (== end of prefix when complete)


def _limit_reached(
    selected: int, tokens: int, token_budget: int | None, max_samples: int | None
) -> StopReason | None:
    if max_samples is not None and selected >= max_samples:
        return "max_samples"
    if token_budget is not None and tokens >= token_budget:
        return "token_budget"
    return None


def select_prefix(
    order: Sequence[str],
    outcomes: Mapping[str, Outcome],
    *,
    token_budget: int | None,
    max_samples: int | None,
    resume_from: Selection | None = None,
) -> Selection:
    """The final prefix if it is decided, else the prefix decided so far.

    ``resume_from`` continues an undecided selection made over a subset of the
    same outcomes (outcomes are only ever added): the walk starts at its
    frontier, so a long run does not rescan the whole order per record.
    """
    if resume_from is not None and not resume_from.complete:
        selected, failed = resume_from.selected, resume_from.failed
        tokens, start = resume_from.tokens, resume_from.frontier
    else:
        selected, failed, tokens, start = [], [], 0, 0
    for pos in range(start, len(order)):
        pid = order[pos]
        reason = _limit_reached(len(selected), tokens, token_budget, max_samples)
        if reason is not None:
            return Selection(selected, failed, tokens, True, reason, pos)
        outcome = outcomes.get(pid)
        if outcome is None:
            return Selection(selected, failed, tokens, False, None, pos)
        if outcome.failed:
            failed.append(pos)
            continue
        if token_budget is not None and tokens + outcome.completion_tokens > token_budget:
            return Selection(selected, failed, tokens, True, "token_budget", pos)
        selected.append(pos)
        tokens += outcome.completion_tokens
    reason = _limit_reached(len(selected), tokens, token_budget, max_samples)
    return Selection(selected, failed, tokens, True, reason or "exhausted", len(order))


def plan_dispatch(
    order: Sequence[str],
    outcomes: Mapping[str, Outcome],
    selection: Selection,
    *,
    token_budget: int | None,
    max_samples: int | None,
    expected_tokens: float,
    limit: int,
    in_flight: Collection[int] = (),
) -> list[int]:
    """Positions to generate next (at most ``limit``), in order.

    Walks on from the frontier counting known outcomes exactly and unknown ones
    (in flight or to dispatch) at ``expected_tokens`` each, and stops where the
    limits would be reached: dispatch stops when committed + expected in-flight
    tokens reach the budget. With nothing in flight the first unknown prompt is
    always included, so progress is guaranteed.
    """
    if selection.complete or limit < 1:
        return []
    batch: list[int] = []
    pending = False  # anything counted at expected_tokens so far
    n_selected = len(selection.selected)
    tokens = float(selection.tokens)
    for pos in range(selection.frontier, len(order)):
        if pending and _limit_reached(n_selected, math.ceil(tokens), token_budget, max_samples):
            break
        outcome = outcomes.get(order[pos])
        if outcome is None:
            if pos not in in_flight:
                batch.append(pos)
            pending = True
            tokens += expected_tokens
            n_selected += 1
            if len(batch) >= limit:
                break
        elif not outcome.failed:
            tokens += outcome.completion_tokens
            n_selected += 1
    return batch


# --------------------------------------------------------------------------- the end of a budget
#
# Near the end, the outcome of position p is needed only if the positions before it do not
# reach the budget: P(needed) = P(committed + lengths of the unknown positions before p <
# budget) (the one that will not fit is needed too: the prefix is decided once it is known).
# The running mean underestimates the unknown lengths twice over when lengths are
# long-tailed: requests still in flight are the long ones (the short ones finished), and the
# observed lengths miss exactly those. So the lengths in flight are estimated from the
# observed distribution *given how far each request has got*, with the requests in flight
# counted as censored observations (Kaplan-Meier), and the sum is judged with its variance.

Z_LIKELY = 0.84  # admit when P(needed) >= 80%
Z_HOPELESS = -2.5  # never admit when P(needed) < 0.6%
Z_ABANDON = -5.0  # cancel a request in flight when P(needed) < 3e-7


def _normal_cdf(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


@dataclass(frozen=True)
class LengthFit:
    """A completion-length distribution (support points and masses) fitted by
    :meth:`LengthModel.fit`, with suffix sums for conditional moments."""

    points: npt.NDArray[np.float64]  # ascending support; the last is the tail bound
    mass: npt.NDArray[np.float64]
    above0: npt.NDArray[np.float64]  # above0[i] = sum(mass[i:]) = P(L > points[i - 1])
    above1: npt.NDArray[np.float64]  # sum(mass[i:] * points[i:])
    above2: npt.NDArray[np.float64]  # sum(mass[i:] * points[i:] ** 2)
    top: float  # what a request longer than anything seen is assumed to reach

    @property
    def mean(self) -> float:
        return float(self.above1[0] / self.above0[0])

    @property
    def var(self) -> float:
        return max(float(self.above2[0] / self.above0[0]) - self.mean**2, 0.0)

    def survival(self, tokens: npt.ArrayLike) -> npt.NDArray[np.float64]:
        """P(L > tokens)."""
        return self.above0[np.searchsorted(self.points, tokens, "right")]

    def conditional(
        self, progress: npt.ArrayLike
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """Mean and variance of L given L > progress, elementwise."""
        a = np.asarray(progress, dtype=np.float64)
        i = np.searchsorted(self.points, a, "right")
        s0, s1, s2 = self.above0[i], self.above1[i], self.above2[i]
        seen = s0 > 1e-12
        s0 = np.where(seen, s0, 1.0)
        # Longer than every observation and past the tail bound (multi-turn): at least a+1.
        mean = np.where(seen, s1 / s0, np.maximum(a + 1.0, self.top))
        var = np.where(seen, np.maximum(s2 / s0 - mean**2, 0.0), 0.0)
        return mean, var

    def expected_max_residual(self, progress: Sequence[float], steps: int = 64) -> float:
        """E[max_x (L_x - a_x) | L_x > a_x]: how long the requests in flight (progress
        a_x) keep the engine busy, i.e. when the last of them is expected to finish."""
        if not progress:
            return 0.0
        a = np.asarray(progress, dtype=np.float64)
        horizon = max(self.top - float(a.min()), 1.0)
        dt = horizon / steps
        t = (np.arange(steps) + 0.5) * dt
        alive = self.survival(a)
        alive_at = self.survival(a[:, None] + t[None, :])
        with np.errstate(divide="ignore", invalid="ignore"):
            done = np.where(alive[:, None] > 1e-12, 1.0 - alive_at / alive[:, None], 1.0)
        all_done = np.prod(np.clip(done, 0.0, 1.0), axis=0)
        return float(np.sum(1.0 - all_done) * dt)


class LengthModel:
    """The last ``window`` completion lengths observed (a sliding window, so the result
    is a function of the completions in order), fitted together with the requests in
    flight as censored observations."""

    def __init__(self, max_tokens: float | None, window: int = 4096) -> None:
        self.max_tokens = max_tokens
        self.window = window
        self._recent: deque[int] = deque()
        self._sorted: list[int] = []
        self._sum = self._sum_sq = 0

    def __len__(self) -> int:
        return len(self._recent)

    def add(self, tokens: int) -> None:
        self._recent.append(tokens)
        bisect.insort(self._sorted, tokens)
        self._sum += tokens
        self._sum_sq += tokens * tokens
        if len(self._recent) > self.window:
            old = self._recent.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
            self._sum -= old
            self._sum_sq -= old * old

    def in_flight_mean(self) -> float:
        """E[L^2] / E[L]: the mean length of a request caught in flight at a random
        moment (long requests are in flight for longer)."""
        return self._sum_sq / self._sum if self._sum else 0.0

    def fit(self, running: Iterable[float] = ()) -> LengthFit | None:
        """Kaplan-Meier over the observed lengths and ``running`` (tokens generated so far
        by each request in flight: it is known to be longer, and leaving it out would bias
        the lengths short). Mass surviving past every observation goes to ``top``."""
        if not self._sorted:
            return None
        obs = np.asarray(self._sorted, dtype=np.float64)
        cens = np.sort(np.asarray(list(running), dtype=np.float64))
        u, died = np.unique(obs, return_counts=True)
        at_risk = (len(obs) - np.searchsorted(obs, u, "left")) + (
            len(cens) - np.searchsorted(cens, u, "left")
        )
        alive = np.cumprod(1.0 - died / at_risk)
        mass = -np.diff(np.concatenate([[1.0], alive]))
        # Past the longest observation: twice it, or max_tokens if lower (a bound that
        # may be far above anything the engine really produces).
        longest = float(u[-1])
        top = 2.0 * longest if self.max_tokens is None else min(self.max_tokens, 2.0 * longest)
        top = max(top, longest + 1.0, float(cens[-1]) + 1.0 if len(cens) else 0.0)
        points = np.append(u, top)
        mass = np.append(mass, alive[-1])

        def suffix(values: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
            return np.append(np.cumsum(values[::-1])[::-1], 0.0)

        return LengthFit(
            points, mass, suffix(mass), suffix(mass * points), suffix(mass * points**2), top
        )


def _expected_lengths(
    fit: LengthFit, in_flight: Mapping[int, float]
) -> dict[int, tuple[float, float]]:
    """Each position in flight: the mean and variance of its length given its progress."""
    positions = sorted(in_flight)
    mean, var = fit.conditional([in_flight[p] for p in positions])
    return dict(zip(positions, zip(mean.tolist(), var.tolist(), strict=True), strict=True))


@dataclass
class _TailWalk:
    """What the positions walked so far (from the frontier) will spend, the one model of
    the tail that admission (:func:`plan_dispatch_tail`) and cancelling
    (:func:`hopeless_in_flight`) both read, so that the plan never admits what the cancel
    rule, on the same state, would cancel.

    Known outcomes count exactly; a conversation in flight at its conditional length given
    its progress, and one not sent yet at the distribution's, each only if it succeeds
    (``p_fail``, the run's observed share of failed conversations: a failed one is skipped
    and spends nothing of the budget). ``floor`` is what they have surely decoded already;
    past the budget it decides, unless one of the conversations in it fails."""

    token_budget: int
    p_fail: float
    mean: float = 0.0
    var: float = 0.0
    floor: float = 0.0
    fallible: int = 0  # conversations in flight whose progress is in the floor

    def known(self, tokens: int) -> None:
        self.mean += tokens
        self.floor += tokens

    def in_flight(self, mean: float, var: float, progress: float) -> None:
        self._uncertain(mean, var)
        self.floor += progress
        self.fallible += 1

    def unsent(self, mean: float, var: float) -> None:
        self._uncertain(mean, var)

    def _uncertain(self, mean: float, var: float) -> None:
        ok = 1.0 - self.p_fail
        self.mean += ok * mean
        self.var += ok * var + self.p_fail * ok * mean * mean

    def p_needed(self) -> float:
        """P(the next position's outcome is needed): the positions before it stay under
        the budget (or one surely over it fails)."""
        if self.floor >= self.token_budget:
            return 1.0 - (1.0 - self.p_fail) ** self.fallible
        room = self.token_budget - self.mean
        if self.var <= 0:
            return 1.0 if room > 0 else 0.0
        return _normal_cdf(room / math.sqrt(self.var))


def plan_dispatch_tail(
    order: Sequence[str],
    outcomes: Mapping[str, Outcome],
    selection: Selection,
    *,
    token_budget: int | None,
    max_samples: int | None,
    fit: LengthFit,
    in_flight: Mapping[int, float],
    limit: int,
    p_fail: float = 0.0,
) -> list[int]:
    """:func:`plan_dispatch` for a streaming engine, aware of the length distribution.

    ``in_flight`` maps each position in flight to the tokens it has generated so far (an
    estimate). Walking on from the frontier (:class:`_TailWalk`), a new position is
    admitted when the prefix likely needs its outcome; never when that is hopeless; in
    between (doubtful) unless the requests before it are expected to run clearly longer
    than it would (its mean plus a standard deviation): while they do, deferring costs
    nothing (the run cannot end before they do) and their lengths settle the doubt;
    otherwise deferring would make it the last to finish. With nothing in flight the
    first unknown position is always admitted (progress).
    """
    if selection.complete or limit < 1:
        return []
    expected = _expected_lengths(fit, in_flight)
    mean, var = fit.mean, fit.var
    batch: list[int] = []
    pending = False
    n_selected = len(selection.selected)
    walk = _TailWalk(token_budget or 0, p_fail)
    walk.known(selection.tokens)
    running: list[float] = []  # progress of the requests before this one (0: dispatched now)
    for pos in range(selection.frontier, len(order)):
        if pending and _limit_reached(n_selected, 0, None, max_samples):
            break
        outcome = outcomes.get(order[pos])
        if outcome is not None:
            if not outcome.failed:
                walk.known(outcome.completion_tokens)
                n_selected += 1
            continue
        n_selected += 1
        if pos in expected:
            walk.in_flight(*expected[pos], in_flight[pos])
            running.append(in_flight[pos])
            pending = True
            continue
        if pending and token_budget is not None:
            needed = walk.p_needed()
            if needed < _normal_cdf(Z_HOPELESS):
                break
            if needed < _normal_cdf(Z_LIKELY) and fit.expected_max_residual(running) > (
                mean + math.sqrt(var)
            ):
                break
        batch.append(pos)
        walk.unsent(mean, var)
        running.append(0.0)
        pending = True
        if len(batch) >= limit:
            break
    return batch


def hopeless_in_flight(
    order: Sequence[str],
    outcomes: Mapping[str, Outcome],
    selection: Selection,
    *,
    token_budget: int | None,
    fit: LengthFit,
    in_flight: Mapping[int, float],
    p_fail: float = 0.0,
) -> set[int]:
    """The requests in flight whose outcome the prefix will almost surely not need
    (P(needed) below ``Z_ABANDON``'s, by the walk :func:`plan_dispatch_tail` admits with:
    :class:`_TailWalk`): cancelling them saves what they would still decode; the rare one
    needed after all is dispatched again. Never one the plan would admit on this state:
    admission stops at a higher P(needed)."""
    if selection.complete or token_budget is None or not in_flight:
        return set()
    last = max(in_flight)
    expected = _expected_lengths(fit, in_flight)
    hopeless: set[int] = set()
    walk = _TailWalk(token_budget, p_fail)
    walk.known(selection.tokens)
    for pos in range(selection.frontier, last + 1):
        outcome = outcomes.get(order[pos])
        if outcome is not None:
            if not outcome.failed:
                walk.known(outcome.completion_tokens)
            continue
        if pos in expected:
            if walk.p_needed() < _normal_cdf(Z_ABANDON):
                hopeless.add(pos)
            walk.in_flight(*expected[pos], in_flight[pos])
        else:
            walk.unsent(fit.mean, fit.var)
    return hopeless


def select_prefix_arrays(
    known: npt.NDArray[np.bool_],
    failed: npt.NDArray[np.bool_],
    completion_tokens: npt.NDArray[np.int64],
    *,
    token_budget: int | None,
    max_samples: int | None,
) -> Selection:
    """:func:`select_prefix` over arrays indexed by position, in O(n) numpy.

    For reports over huge journals (a million prompts in milliseconds instead of
    seconds); generation keeps the incremental pure-Python version. Equal results
    are asserted by a randomised test.
    """
    ok = known & ~failed
    tokens = np.where(ok, completion_tokens, 0)
    # Selected count and tokens *before* each position (exact up to the first stop).
    count_before = np.concatenate([[0], np.cumsum(ok)])
    tokens_before = np.concatenate([[0], np.cumsum(tokens)])
    n = len(known)
    limit = np.zeros(n + 1, dtype=bool)  # _limit_reached, checked first at each position
    if max_samples is not None:
        limit |= count_before >= max_samples
    if token_budget is not None:
        limit |= tokens_before >= token_budget
    over = np.zeros(n, dtype=bool)
    if token_budget is not None:
        over = ok & (tokens_before[:n] + tokens > token_budget)
    stop = limit[:n] | ~known | over
    end = int(np.argmax(stop)) if stop.any() else n
    positions = np.arange(end)
    selected = positions[ok[:end]].tolist()
    failed_positions = positions[failed[:end] & known[:end]].tolist()
    spent = int(tokens_before[end])
    if end < n and not limit[end] and not known[end]:
        return Selection(selected, failed_positions, spent, False, None, end)
    if end < n:
        reason = _limit_reached(len(selected), spent, token_budget, max_samples) or "token_budget"
        return Selection(selected, failed_positions, spent, True, reason, end)
    reason = _limit_reached(len(selected), spent, token_budget, max_samples)
    return Selection(selected, failed_positions, spent, True, reason or "exhausted", n)
