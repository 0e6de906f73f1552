"""Where every file of a run lives: the one owner of the results layout.

The rules declare their inputs and outputs with these patterns (``{dataset}`` and
``{shard}`` are Snakemake wildcards); code that looks at a run from outside, such as
``eagle3data-status`` and the dry-run preview, fills the same patterns through
:class:`Results`, under any workflow directory. Paths are relative to the workflow
directory, as Snakemake sees them.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path

RESULTS = "results"
# Undeclared progress (Snakemake deletes the declared outputs of failed jobs): generation
# journals, shard specs, summaries cached by the status command, GPU locks.
WORK = f"{RESULTS}/.work"

PROMPTS = f"{RESULTS}/prompts/{{dataset}}.parquet"
SKIPPED_PROMPTS = f"{RESULTS}/prompts/{{dataset}}.skipped.jsonl"
# The images of the prompts, one row per distinct image (eagle3data.images).
PROMPT_IMAGES = f"{RESULTS}/prompts/{{dataset}}.images.parquet"

RESPONSES = f"{RESULTS}/responses/{{dataset}}.jsonl"
RESPONSE_STATS = f"{RESULTS}/responses/{{dataset}}.stats.json"
RESPONSE_ERRORS = f"{RESULTS}/responses/{{dataset}}.errors.jsonl"
# One row per generated conversation (used or not): the journal summarised, for the report.
RESPONSE_RECORDS = f"{RESULTS}/responses/{{dataset}}.records.parquet"
JOURNAL_DIR = f"{WORK}/generate/{{dataset}}"
JOURNAL = f"{JOURNAL_DIR}/{{key}}.jsonl"  # key: a hash of the generation settings

TOKENIZED = f"{RESULTS}/tokenized/{{dataset}}.parquet"
TOKENIZE_STATS = f"{RESULTS}/tokenized/{{dataset}}.stats.json"

SHARD_DIR = f"{RESULTS}/hidden_states/{{dataset}}"
SHARD_PLAN = f"{SHARD_DIR}/plan.json"
SHARD = f"{SHARD_DIR}/shard-{{shard}}.h5"
MANIFEST_NAME = "manifest.json"
MANIFEST = f"{SHARD_DIR}/{MANIFEST_NAME}"
SHARD_SPEC_DIR = f"{WORK}/shards/{{dataset}}"
SHARD_SPEC = f"{SHARD_SPEC_DIR}/shard-{{shard}}.json"
SHARD_GLOB = "shard-*.h5"

DRAFT_VOCAB = f"{RESULTS}/vocab/draft_vocab.pt"
DRAFT_VOCAB_SUMMARY = f"{RESULTS}/vocab/draft_vocab.json"
SPECFORGE = f"{RESULTS}/specforge/{{dataset}}"
SPECFORGE_WORK = f"{WORK}/specforge"
# One vLLM speculators training folder for every dataset (consumers/speculators.py).
SPECULATORS = f"{RESULTS}/speculators"
SPECULATORS_WORK = f"{WORK}/speculators"
DRAFT_CHECK = f"{RESULTS}/draft_check/summary.json"
REPORT_FIGURE = f"{RESULTS}/report/{{figure}}.png"
REPORT_SUMMARY = f"{RESULTS}/report/summary.html"

# Job logs, as the rules name them: logs/{rule}/{dataset}.log, or logs/{rule}/{dataset}/
# for jobs that split a dataset (hidden-state shards).
LOGS = "logs"

STATUS_CACHE = f"{WORK}/status"
GPU_LOCKS = f"{WORK}/gpu-locks"
# One folder of request slots per generation endpoint, shared by the datasets' jobs.
ENDPOINT_SLOTS = f"{WORK}/endpoint-slots"
DEMO_MODEL = "resources/models/SmolLM2-135M-Instruct"


def shard_name(shard: int) -> str:
    """The ``{shard}`` wildcard of shard number ``shard`` (five digits)."""
    return f"{shard:05d}"


def shard_number(path: Path, suffix: str) -> int | None:
    """The number of a ``shard-NNNNN.<suffix>`` file, or None for any other name."""
    stem = path.name.removesuffix(f".{suffix}")
    if stem == path.name or not stem.startswith("shard-") or not stem[6:].isdigit():
        return None
    return int(stem[6:])


@dataclass(frozen=True)
class Results:
    """The layout under one workflow directory."""

    workdir: Path = Path(".")

    def path(self, pattern: str, **wildcards: object) -> Path:
        """``pattern`` with its wildcards filled in (``shard`` may be an int)."""
        if isinstance(wildcards.get("shard"), int):
            wildcards["shard"] = shard_name(wildcards["shard"])  # type: ignore[arg-type]
        return self.workdir / pattern.format(**wildcards)

    @property
    def root(self) -> Path:
        return self.workdir / RESULTS

    def job_logs(self, dataset: str) -> list[Path]:
        """The logs of the dataset's jobs (a running job's run file sits beside its log:
        :mod:`eagle3data.jobs`)."""
        logs, name = self.workdir / LOGS, glob.escape(dataset)
        return sorted([*logs.glob(f"*/{name}.log"), *logs.glob(f"*/{name}/*.log")])

    def shard_files(self, dataset: str) -> list[Path]:
        """The shard files now in a dataset's directory, in shard order (``dataset="*"``:
        of every dataset directory)."""
        return sorted(self.workdir.glob(f"{SHARD_DIR.format(dataset=dataset)}/{SHARD_GLOB}"))
