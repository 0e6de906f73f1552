"""Generation, then capture: the two phases of a run on one GPU box.

On one 8-GPU server the generation server (SGLang or vLLM, the user's) and the capture
engine (``hidden_states``, ours) each want every GPU. Unless the config says the
capture has GPUs of its own (``hidden_states.share_gpus_with_generation: false``):

* no capture job starts before every dataset is generated and tokenized (the rules give
  ``plan_shards`` every dataset's tokenize stats as input: :func:`capture_waits_for_all`);
* a capture job that takes GPUs refuses to start while a generation endpoint on this
  machine still answers (:func:`check_generation_stopped`): its server holds the GPUs;
* the dry run says which phase is next (:func:`next_phase_line`).

docs/runbook.md gives the two commands: phase 1 (``snakemake generation``, server up),
phase 2 (``snakemake``, server stopped).
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .. import layout
from ..errors import PhaseError
from ..gpu_slots import job_gpus


def capture_waits_for_all(config: Mapping[str, Any]) -> bool:
    """Whether the capture of any dataset waits for every dataset's generation: the
    capture takes GPUs on this machine and shares them with generation."""
    hidden = config["hidden_states"]
    return (
        bool(hidden.get("share_gpus_with_generation", True))
        and job_gpus(config, "hidden_states") > 0
    )


def _this_machine() -> set[str]:
    names = {"localhost", socket.gethostname(), socket.getfqdn()}
    addresses: set[str] = set()
    for name in names:
        with contextlib.suppress(OSError):
            addresses.update(info[4][0] for info in socket.getaddrinfo(name, None))
    return {n.lower() for n in names} | addresses


def _is_local(host: str) -> bool:
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).is_loopback:
            return True
    return host.lower() in _this_machine()


def local_generation_endpoints(config: Mapping[str, Any]) -> list[str]:
    """The generation endpoints on this machine whose server a GPU capture must not run
    beside (none when the capture has GPUs of its own or takes none)."""
    generation = config["generation"]
    if generation.get("backend") != "openai" or not capture_waits_for_all(config):
        return []
    return [
        url for url in generation.get("endpoints", []) if _is_local(urlsplit(url).hostname or "")
    ]


def check_generation_stopped(endpoints: Sequence[str], timeout_s: float = 2.0) -> None:
    """Refuse to start the capture while a generation server on this machine answers."""
    for url in endpoints:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            with socket.create_connection((parts.hostname, port), timeout=timeout_s):
                pass
        except OSError:
            continue
        raise PhaseError(
            f"the generation server at {url} still answers on this machine, and the capture "
            f"needs the GPUs it holds: stop it once generation is done (phase 1, "
            f"`snakemake generation`), then run phase 2 (docs/runbook.md); if the capture "
            f"has GPUs of its own, set hidden_states.share_gpus_with_generation: false"
        )


def next_phase_line(config: Mapping[str, Any], root: Path = Path(".")) -> str:
    """The dry run's word on what comes next (from the files on disk, so a dataset whose
    settings changed since may still show as done)."""
    datasets = list(config["datasets"])
    to_generate = [d for d in datasets if not (root / layout.RESPONSES.format(dataset=d)).exists()]
    to_capture = [d for d in datasets if not (root / layout.MANIFEST.format(dataset=d)).exists()]
    local = local_generation_endpoints(config)
    if to_generate:
        server = f"; the generation server ({', '.join(local)}) must be up" if local else ""
        if capture_waits_for_all(config):
            then = "capture waits until every dataset is generated and tokenized"
        elif config["hidden_states"]["share_gpus_with_generation"]:
            then = "capture overlaps it (its jobs take no GPU here)"
        else:
            then = "capture overlaps it (hidden_states.share_gpus_with_generation: false)"
        return (
            f"Next phase: generation of {', '.join(to_generate)}{server} "
            f"(docs/runbook.md, phase 1); {then}"
        )
    if to_capture:
        stop = f"; stop the generation server ({', '.join(local)}) first" if local else ""
        return (
            f"Next phase: capture of {', '.join(to_capture)}, the target loaded once"
            f"{stop} (docs/runbook.md, phase 2)"
        )
    return "Next phase: none left: every dataset is generated and captured"
