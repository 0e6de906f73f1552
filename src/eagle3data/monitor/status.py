"""``eagle3data-status``: is it running, where will it end, what if the limits change.

Run in the workflow directory (or point at it with ``-d``). Prints one row per dataset
(:mod:`.snapshot`: state, stage, the budget prefix so far, the projected end, why it
stops, waste (with what requests cancelled in flight decoded), rate and ETA of a running
job, shards and bytes), then where each dataset ends under its current limits and the
basis of that. ``--budget DS=N`` and
``--max-samples DS=N`` (repeatable; ``10M``, ``2.5k``, ``none``) show the same under other
limits without editing any file (:mod:`.whatif`); ``--plot DIR`` draws the report's
budget and throughput pictures from the journals as they are now; ``--json`` prints the
rows for scripts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Collection, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..config import load_config, schema_for
from ..errors import UserError
from ..layout import Results
from .preview import model_bytes_per_token
from .report_data import BudgetBar, BudgetUse, JournalSeries, journal_note
from .report_figures import plot_live
from .snapshot import (
    DatasetSnapshot,
    capture_lines,
    dataset_snapshot,
    format_table,
    notes_lines,
    projection_lines,
)
from .whatif import Change, apply_changes, parse_changes, whatif_lines

CONFIG = Path("config") / "config.yaml"


def snapshots(
    config: dict[str, Any], results: Results, now: float, only: Collection[str] | None = None
) -> list[DatasetSnapshot]:
    """Every dataset's snapshot (or those in ``only``), in config order."""
    per_token = model_bytes_per_token(config)
    return [
        dataset_snapshot(config, ds, results, per_token, now)
        for ds in config["datasets"]
        if only is None or ds in only
    ]


def wrong_directory_hint(directory: Path) -> str:
    """What to say when ``directory`` has no workflow config: where one is, if above."""
    here = directory.resolve()
    hint = (
        f"no {CONFIG} in {here}: run eagle3data-status in the workflow directory (the one "
        "with the Snakefile), or point at it with -d DIR"
    )
    above = next(
        (p for p in here.parents if (p / "Snakefile").is_file() and (p / CONFIG).is_file()), None
    )
    return hint + (f" (this looks like one: -d {above})" if above else "")


def plot(shots: Sequence[DatasetSnapshot], out_dir: Path) -> list[Path]:
    bars, series = [], []
    for shot in shots:
        r = shot.status
        bars.append(
            BudgetBar(
                r.dataset,
                BudgetUse(
                    r.completion_tokens,
                    r.waste_tokens,
                    r.token_budget,
                    r.abandoned_tokens,
                    r.abandoned_tokens_estimated,
                ),
                r.stop_reason,
            )
        )
        if shot.progress is not None:
            journal = shot.progress.journal  # what the engine generated, cancelled too
            series.append(JournalSeries(r.dataset, journal, journal_note(journal)))
    return plot_live(bars, series, out_dir)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3data-status", description=__doc__.split("\n")[0])
    parser.add_argument("-d", "--directory", type=Path, default=Path("."), help="workflow dir")
    parser.add_argument("--config", type=Path, help=f"default: DIRECTORY/{CONFIG}")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    what_if = "what if: the status with this limit instead (nothing is changed), e.g. B2=10M"
    parser.add_argument("--budget", action="append", default=[], metavar="DS=N", help=what_if)
    parser.add_argument(
        "--max-samples",
        action="append",
        default=[],
        metavar="DS=N",
        help="the same for max_samples",
    )
    parser.add_argument(
        "--plot", type=Path, metavar="DIR", help="draw budget_use.png and throughput.png there"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    config_file = args.config or args.directory / CONFIG
    if not config_file.is_file():
        where = args.directory
        why = f"{args.config}: no such file" if args.config else wrong_directory_hint(where)
        print(f"eagle3data-status: {why}", file=sys.stderr)
        return 2
    schema = schema_for(args.directory)
    try:
        changes: list[Change] = parse_changes(args.budget, args.max_samples)
        config = load_config(config_file, schema)
        changed = apply_changes(config, changes, schema) if changes else config
    except Exception as exc:  # a config or a change the workflow itself would refuse
        print(f"eagle3data-status: {config_file}: {exc}", file=sys.stderr)
        return 2
    # Once each: without a change, ``changed`` is ``config`` (a relative -d would repeat).
    for cfg in [config] if changed is config else [config, changed]:
        if not Path(cfg["model"]["path"]).is_absolute():
            cfg["model"]["path"] = str(args.directory / cfg["model"]["path"])
    results, now = Results(args.directory), time.time()
    only = {c.dataset for c in changes} or None  # a what-if is about the datasets it changes
    try:
        shots = snapshots(changed, results, now, only)
        current = shots if changed is config else snapshots(config, results, now, only)
    except UserError as exc:  # e.g. a journal holding a newer build's kind of record
        print(f"eagle3data-status: {exc}", file=sys.stderr)
        return 2
    rows = [s.status for s in shots]
    before = {r.dataset: r for r in (s.status for s in current)}
    if args.json:
        out: dict[str, Any] = {
            "bytes_per_token": model_bytes_per_token(changed),
            "datasets": [asdict(r) for r in rows],
        }
        if changes:
            out["what_if"] = [asdict(c) for c in changes]
            out["current"] = [asdict(before[r.dataset]) for r in rows]
        print(json.dumps(out))
    else:
        if changes:
            what = "; ".join(f"{c.dataset} {c.describe(config)}" for c in changes)
            print(f"As if {what} (nothing was changed):")
        print(format_table(rows))
        print()
        if changes:  # the what-if says where each changed dataset ends
            after = {r.dataset: r for r in rows}
            print("\n".join(whatif_lines(config, changes, before, after)))
        else:
            print("\n".join(projection_lines(changed, rows)))
        if notes := notes_lines(rows):
            print("\n".join(["", *notes]))
        if captured := capture_lines(rows):
            print("\n".join(["", *captured]))
    if args.plot is not None:
        for path in plot(shots, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
