"""How a Snakemake script runs its stage: the job's log, its GPUs, and how it ends.

Every script is one call, ``run_step(snakemake.log[0], stage_function, **arguments)``:

* logging goes to the job's log file (line by line) and to stderr, set up once;
* a job that needs GPUs takes them first (``gpus=``), before the stage can import
  torch: CUDA reads ``CUDA_VISIBLE_DEVICES`` once (see :mod:`eagle3data.gpu_slots`);
* a :class:`~eagle3data.errors.UserError` (config, data, environment) ends the job with
  its message as one line; anything else is a bug and keeps its traceback;
* SIGINT or SIGTERM stops it with one line too (:mod:`eagle3data.driver_signals`): what
  was kept, and that the same command resumes;
* while it runs, a run file beside its log (``logs/{rule}/{dataset}.run.json``,
  :mod:`eagle3data.liveness`) tells ``eagle3data-status`` that the job is alive;
* libraries draw no progress bars (transformers' ``Loading weights``, tqdm): in a job log
  they are noise, and the stages log their own progress.

Neither way out imports anything: a stopped job must exit at once, not after seconds
of importing torch to find out what went wrong.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .driver_signals import signal_name, stop_on_signals
from .errors import is_user_error
from .liveness import Heartbeat

if TYPE_CHECKING:
    from .gpu_slots import GpuRequest

log = logging.getLogger(__name__)


def setup_logging(log_path: str | None) -> None:
    """Log to the job's log file (appending) and to stderr."""
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if log_path:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_path, mode="a"))
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(message)s",
        handlers=handlers,
        force=True,
    )


def run_step(
    log_path: str | None,
    step: Callable[..., None],
    /,
    *,
    gpus: GpuRequest | None = None,
    checks: Sequence[Callable[[], None]] = (),
    **kwargs: Any,
) -> None:
    """Run one stage function with ``kwargs``, as a job; exit 1 on any failure.
    ``checks`` run first, before the GPUs are taken (a refusal is a one-line error)."""
    # Read when huggingface_hub and tqdm are imported, so before the stage imports them;
    # a user who set them keeps their choice.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    setup_logging(log_path)
    stop_on_signals()
    try:
        with contextlib.ExitStack() as alive:
            if log_path:
                alive.enter_context(Heartbeat(Path(log_path)))
            for check in checks:
                check()
            if gpus is not None:
                gpus.acquire()
            step(**kwargs)
    except KeyboardInterrupt as stop:
        log.error(
            "%s stopped by %s; finished outputs are kept and nothing partial was written; "
            "run the same command to resume",
            step.__name__,
            signal_name(stop),
        )
        raise SystemExit(1) from None
    except Exception as exc:
        if is_user_error(exc):
            log.error("%s", exc)
        else:
            log.exception("%s failed", step.__name__)
        raise SystemExit(1) from None
