"""One change to SGLang 0.5.23 for its CPU engine in the test suite: DeepSeek/Kimi MLA
attention on the ``torch_native`` backend takes SGLang's absorbed-MLA path.

Why: SGLang's DeepSeek-V2 attention asks ``AttentionBackendRegistry`` which forward method
each backend wants (``models/deepseek_common/attention_backend_handler.py``). ``torch_native``
has no entry, so it gets the ``triton`` handler's answer, ``AttnForwardMethod.MHA`` for a
prefill without a cached prefix. That path (``forward_mha.py`` ``forward_normal_core``)
hands the expanded per-head K (``qk_nope_head_dim + qk_rope_head_dim`` = 192 wide for
K2.5) to ``TorchNativeAttnBackend.forward_extend``, which attends over the KV pool's
buffers instead, and an MLA pool holds the latent (``kv_lora_rank + qk_rope_head_dim`` =
576): ``RuntimeError: Expected size for first two dimensions of batch2 tensor to be:
[8, 192] but got: [8, 576]`` in ``torch_native_backend.py`` ``_run_sdpa_forward_extend``.
On GPUs (and AMX CPUs, ``intel_amx``) that dispatch never reaches ``torch_native``.

The change registers a ``torch_native`` handler that answers what SGLang's own dispatch
answers for a backend without an MHA prefill (``_dispatch_mla_subtype``: the absorbed
MLA method, the one every decode step uses), so prefill attends over the latent pool,
which ``torch_native`` supports. Everything else (weights, MoE, norms, the aux-state
capture, our forward hook, the layer-id rule) is SGLang's code unchanged.

It is applied when that module is first imported, in every process of the engine: this
directory is first on ``PYTHONPATH`` (``tests/support/sglang_cpu.py``), so Python imports
this file at start-up. Production never sees it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

HANDLER_MODULE = "sglang.srt.models.deepseek_common.attention_backend_handler"


def _register_torch_native(module: Any) -> None:
    def handle_attention_torch_native(attn: Any, forward_batch: Any) -> Any:
        return module._dispatch_mla_subtype(attn, forward_batch)

    module.AttentionBackendRegistry.register("torch_native", handle_attention_torch_native)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs :func:`_register_torch_native` right after SGLang's module executes."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != HANDLER_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            _register_torch_native(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if HANDLER_MODULE in sys.modules:
    _register_torch_native(sys.modules[HANDLER_MODULE])
else:
    sys.meta_path.insert(0, _AfterImport())
