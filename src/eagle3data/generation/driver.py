"""The generation driver: order, budget, sidecar, resume, progress, accounting.

It knows no engine. Finished prompts are appended to a sidecar journal
(``results/.work/...``) as they complete; the declared output is assembled from
the journal, atomically, only once the budget prefix is decided. A killed job
therefore loses at most the batch in flight, and a re-run counts every token
already in the journal against the budget.

In-process engines get batches whose composition depends only on the
journal's content, never on timing, so an interrupted and resumed run makes the
same batches as an uninterrupted one and (greedy decoding) writes byte-identical
output. HTTP engines get single conversations as capacity frees up; which ones
are in flight depends on timing, but the output does not: it is the prefix
selected from the journal, and each conversation's answer depends only on the
conversation (for a deterministic server).

Tool calling: the source's assistant turns are regenerated wherever it had one, after
each user turn and after each run of tool turns, on the regenerated history so far plus
the source's system, user and tool turns in order; a conversation's ``tools`` go with
every request. Tools are never executed: the source's tool results stay as given, even
where a regenerated turn calls other tools (or none) than the source's did, so what the
target is shown stays a function of the source alone. Only their ``tool_call_id`` follows
the regenerated calls, when there are as many calls as results (``answering``): a
regenerated call's id is new, templates such as Kimi-K2.5's render both ids, and some
servers refuse a result that answers no call of the turn before (OpenAI's API; SGLang
0.5.23 for MiniMax-M3 only). With another number of calls the results stay as given; such
a server refuses that history and the prompt fails with its message, like any other 4xx.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..driver_signals import signal_name, stop_deferred
from ..errors import GenerationAborted
from .conversation import regenerate
from .engines import Engine
from .job import GenerationJob, GenerationResult, Prompt
from .journal import JournalWriter
from .result import assemble, write_outputs
from .run import Run, load_journal, stopped_message
from .run_state import ErrorLimits
from .streaming import stream

log = logging.getLogger(__name__)

# The stage's API (what the stage function, tests and benchmarks import from here). The
# job's data is job.py, a conversation's turns conversation.py, the run's state run.py and
# run_state.py, streaming dispatch streaming.py, the outputs result.py.
__all__ = [
    "ErrorLimits",
    "GenerationJob",
    "GenerationResult",
    "Prompt",
    "load_journal",
    "regenerate",
    "run_generation",
    "stopped_message",
    "write_outputs",
]


def run_generation(
    job: GenerationJob,
    engine_factory: Any,
    *,
    streaming: bool = False,
    error_limits: ErrorLimits | None = None,
) -> GenerationResult:
    """Generate until the budget prefix is decided; return the final rows and stats.

    ``engine_factory`` is called only if something remains to be generated, so a
    re-run over a finished journal (e.g. a lowered budget) never loads a model.
    With ``streaming`` it must return an :class:`AsyncEngine` (HTTP): requests
    are kept in flight up to its capacity and each finished conversation is
    journaled at once; otherwise an in-process :class:`Engine` gets batches.
    """
    # Lock before reading: another writer finishing between our read and our
    # first append would otherwise make us regenerate what it just wrote.
    with JournalWriter(job.journal) as journal:
        if journal.repaired_bytes:
            log.warning(
                "%s: dropped a torn last record (%d bytes) from %s",
                job.dataset,
                journal.repaired_bytes,
                job.journal,
            )
        run = Run(job, journal)
        log.info(
            "%s: %d prompts, %d finished records in %s%s",
            job.dataset,
            len(run.order),
            run.resumed,
            job.journal,
            " (resuming)" if run.resumed else "",
        )
        if not run.sel.complete:
            try:
                if streaming:
                    asyncio.run(stream(run, engine_factory, error_limits or ErrorLimits()))
                else:
                    _batched(run, engine_factory)
            except KeyboardInterrupt as stop:  # SIGINT, or SIGTERM (driver_signals)
                raise GenerationAborted(stopped_message(run, signal_name(stop))) from None
    run.progress.update(run.sel, run.records, force=True, abandoned_tokens=run.abandoned_tokens)
    return assemble(
        job,
        run.order,
        run.records,
        run.sel,
        run.resumed,
        run.generated_now,
        run.engine_notes,
        run.abandoned,
    )


def _batched(run: Run, engine_factory: Any) -> None:
    """In-process engines: deterministic batches, each journaled as a whole."""
    engine: Engine = engine_factory()
    while not run.sel.complete:
        batch = run.plan(run.job.batch_size)
        new = regenerate(engine, [run.by_id[run.order[pos]] for pos in batch], run.job.seed)
        # A stop between the append and the counts would say fewer responses are kept
        # than the journal holds.
        with stop_deferred():
            run.commit(new)
