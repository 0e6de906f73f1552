"""What-if: the status under other limits, without editing any file.

``eagle3data-status --budget B2=10M --max-samples B3=7000`` applies the changes to the
loaded config only, checks them against the schema, and computes every row from that
config with the same code as the plain status. The prefix is selected from the journal
exactly as generation selects it, so where it is decided (the journal already holds
it), its conversations, tokens and waste are what a re-run with the same change writes
(``tests/workflow/test_midnight.py`` checks this against a real re-run); where it is
not, the rest is projected like any other dataset's. Requests cancelled in flight
(abandoned records) change no selection, theirs or a re-run's: their decode is waste.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..config import validate_config
from ..units import human_count, parse_count
from .preview import cancelled_note
from .snapshot import DatasetStatus, end_text, to_go_text

Limit = Literal["token_budget", "max_samples"]
NO_LIMIT = "none"


@dataclass(frozen=True)
class Change:
    dataset: str
    key: Limit
    value: int | None  # None: no limit

    def describe(self, config: Mapping[str, Any]) -> str:
        now = config["datasets"][self.dataset].get(self.key)
        return f"{self.key} {_limit(self.value)} (now {_limit(now)})"


def _limit(value: int | None) -> str:
    return NO_LIMIT if value is None else human_count(value)


def parse_change(text: str, key: Limit) -> Change:
    """``B2=10M`` (or ``B2=none``: no limit) for ``key``."""
    dataset, sep, value = text.partition("=")
    if not sep or not dataset:
        raise ValueError(f"{text!r}: expected DATASET=N, e.g. B2=10M")
    if value.strip().lower() == NO_LIMIT:
        return Change(dataset, key, None)
    return Change(dataset, key, parse_count(value))


def parse_changes(budgets: Sequence[str], max_samples: Sequence[str]) -> list[Change]:
    return [parse_change(t, "token_budget") for t in budgets] + [
        parse_change(t, "max_samples") for t in max_samples
    ]


def apply_changes(
    config: Mapping[str, Any], changes: Sequence[Change], schema: Path
) -> dict[str, Any]:
    """A copy of ``config`` with the changes, checked against ``schema`` as the workflow
    would check the edited file."""
    changed = copy.deepcopy(dict(config))
    for change in changes:
        datasets = changed["datasets"]
        if change.dataset not in datasets:
            raise ValueError(
                f"no dataset {change.dataset!r} in the config (there are {', '.join(datasets)})"
            )
        if change.value is None:
            datasets[change.dataset].pop(change.key, None)
        else:
            datasets[change.dataset][change.key] = change.value
    return validate_config(changed, schema)


def whatif_lines(
    config: Mapping[str, Any],
    changes: Sequence[Change],
    before: Mapping[str, DatasetStatus],
    after: Mapping[str, DatasetStatus],
) -> list[str]:
    """Per changed dataset: the prefix, the waste of what is already generated, what
    generation would still do, and the end; ``before``/``after``: rows by dataset under
    the current config and the changed one."""
    lines = [
        "What if (nothing was changed; the same change in the config file makes a re-run do this):"
    ]
    for dataset in dict.fromkeys(c.dataset for c in changes):
        what = ", ".join(c.describe(config) for c in changes if c.dataset == dataset)
        then = after[dataset]
        lines.append(f"  {dataset} with {what}:")
        tokens = (
            f"{then.conversations_done} conversations, {then.completion_tokens} completion tokens"
        )
        if then.stop_reason is not None:
            lines.append(f"    output: {tokens} (decided: it stops at {then.stop_reason})")
            wasted = f"{then.waste_tokens} of them wasted"
        else:
            lines.append(f"    output so far: {tokens} (the rest is not decided yet)")
            wasted = f"{then.waste_tokens} of them outside the output so far"
        wasted += cancelled_note(then.abandoned_tokens, then.abandoned_tokens_estimated)
        lines.append(f"    already generated: {then.generated_tokens} completion tokens, {wasted}")
        if then.tokens_to_generate == 0:
            only = "; the generate job only writes the output" if then.stage == "generate" else ""
            lines.append(f"    generation: nothing to generate{only}")
        else:
            lines.append(f"    generation: {to_go_text(then)}")
        lines.append(f"    end: {end_text(then)}")
        lines.append(f"    (now: {end_text(before[dataset])})")
    return lines
