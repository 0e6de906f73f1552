"""Real SGLang on CPU for the test suite: the offline engine (capture) and the HTTP server
(generation), with SGLang's own code, in the environment ``tests/sglang/setup.sh`` builds.

Checked facts (sglang 0.5.23 from the registry, installed ``--no-deps`` with the CPU-path
imports of ``tests/sglang/requirements.txt`` at the versions of ``constraints/gpu.txt``; a
2-core AMD EPYC with AVX512, no AMX):

* SGLang picks its CPU platform only when ``SGLANG_USE_CPU_ENGINE=1`` (``is_cpu()`` reads
  it); without it the unknown-device path dies importing vLLM's custom ops.
* It then imports a few helper ops from ``sgl_kernel`` whatever the CPU; the registry's
  ``sglang-kernel`` is CUDA-only, so ``tests/support/sglang_cpu_site`` goes first on
  ``PYTHONPATH`` (its docstring says what it replaces). Every process SGLang spawns
  (scheduler, detokenizer) inherits the environment, so :func:`sglang_env` is set before
  the engine or server starts.
* torch: sglang 0.5.23 pins ``torch==2.14.1`` and imports ``torchvision`` at module level
  (``srt/configs/deepseek_ocr.py``); the registry's torchvision links against torch's CUDA
  libraries and does not load beside the CPU build of torch, so the environment takes
  sglang's own pin, the registry's (CUDA) torch 2.14.1 with torchvision 0.29.1, which
  computes on the CPU when no GPU is visible.
* Engine options that work on such a CPU (:data:`CPU_ENGINE_ARGS`): ``device: cpu``,
  ``attention_backend: torch_native`` (SGLang picks ``intel_amx`` on x86 otherwise),
  cuda graphs off, and a bounded KV pool (``max_total_tokens``): the pool is otherwise
  sized from ``mem_fraction_static`` of the machine's memory.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SGLANG_VERSION = "0.5.23"
# sgl_kernel (the stand-in) and sitecustomize.py (the one change to SGLang), first on
# PYTHONPATH of every SGLang process.
SITE_DIR = Path(__file__).resolve().parent / "sglang_cpu_site"
SETUP_COMMAND = "bash tests/sglang/setup.sh && .venv-sglang/bin/pytest tests/sglang"

# ServerArgs fields for a CPU without AMX (see the module docstring).
CPU_ENGINE_ARGS: dict[str, Any] = {
    "device": "cpu",
    "attention_backend": "torch_native",
    "max_total_tokens": 8192,
}


def sglang_problem() -> str | None:
    """Why real SGLang cannot run in this interpreter, or None."""
    # The distribution, not find_spec("sglang"): with tests/ on sys.path (pytest's
    # pythonpath), tests/sglang/ itself is an importable namespace package.
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return f"sglang is not installed here (the SGLang suite: {SETUP_COMMAND})"
    if version != SGLANG_VERSION:
        return f"sglang {version} is installed; the CPU suite is checked on {SGLANG_VERSION}"
    return None


def sglang_env(base: Mapping[str, str] | None = None, *, ranks: int = 1) -> dict[str, str]:
    """``base`` (default: this process's environment) with SGLang's CPU platform chosen
    and the ``sgl_kernel`` stand-in first on ``PYTHONPATH``, for an engine of ``ranks``
    worker processes (tp_size x dp_size without data-parallel attention, else tp_size)."""
    env = dict(os.environ if base is None else base)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    # SGLang's PyNccl loads libnccl.so.2 whenever it can, and then insists on a CUDA device
    # ("Expected a cuda device, but got: cpu" as the first TP group forms). A CPU machine
    # has no NCCL; the test environment's torch is the registry's CUDA build, which brings
    # one. A path that does not exist gives SGLang the CPU machine's view: no NCCL, ranks
    # all-reduce over gloo.
    env["SGLANG_NCCL_SO_PATH"] = str(SITE_DIR / "no-nccl-on-a-cpu-machine")
    if ranks > 1:
        # SGLang pins each rank's OpenMP threads to a NUMA node unless told which cores
        # each rank takes, and refuses more ranks than NUMA nodes (one here): share the cores.
        cores = sorted(os.sched_getaffinity(0))
        groups = [cores[i::ranks] or cores for i in range(ranks)]
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, group)) for group in groups)
    else:
        env.pop("SGLANG_CPU_OMP_THREADS_BIND", None)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(SITE_DIR), *(p for p in paths if p != str(SITE_DIR))])
    return env


def use_sglang_cpu(ranks: int = 1) -> None:
    """Set :func:`sglang_env` in this process (before ``import sglang``): for an
    in-process engine and every worker it spawns (new interpreters, which run the
    directory's ``sitecustomize`` at start-up); this one runs it now."""
    import importlib.util
    import sys

    env = sglang_env(ranks=ranks)
    os.environ.update(env)
    if "SGLANG_CPU_OMP_THREADS_BIND" not in env:
        os.environ.pop("SGLANG_CPU_OMP_THREADS_BIND", None)
    if str(SITE_DIR) not in sys.path:
        sys.path.insert(0, str(SITE_DIR))
    name = "eagle3data_tests_sglang_cpu_site"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SITE_DIR / "sitecustomize.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
