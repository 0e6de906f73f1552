"""How a Snakemake script runs its stage: the job's log, its GPUs, and how it ends.

Every script is one call, ``run_step(snakemake.log[0], stage_function, **arguments)``:

* logging goes to the job's log file (line by line) and to stderr, set up once;
* a job that needs GPUs takes them first (``gpus=``), before the stage can import
  torch: CUDA reads ``CUDA_VISIBLE_DEVICES`` once (see :mod:`eagle3data.gpu_slots`);
* a :class:`~eagle3data.errors.UserError` (config, data, environment) ends the job with
  its message as one line; anything else is a bug and keeps its traceback.

Neither way out imports anything: a stopped job must exit at once, not after seconds
of importing torch to find out what went wrong.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import is_user_error

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
    **kwargs: Any,
) -> None:
    """Run one stage function with ``kwargs``, as a job; exit 1 on any failure."""
    setup_logging(log_path)
    try:
        if gpus is not None:
            gpus.acquire()
        step(**kwargs)
    except Exception as exc:
        if is_user_error(exc):
            log.error("%s", exc)
        else:
            log.exception("%s failed", step.__name__)
        raise SystemExit(1) from None
