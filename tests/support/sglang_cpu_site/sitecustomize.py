"""Two changes to SGLang 0.5.23 for its CPU engine in the test suite, both to the
``torch_native`` attention backend, which a GPU box (and an AMX CPU, ``intel_amx``) never
runs: DeepSeek/Kimi MLA attention takes SGLang's absorbed-MLA path, and the backend pads
a data-parallel-attention batch as ``intel_amx`` does.

**MLA.**
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

**Data-parallel attention.** Every attention-DP group pads its batch to the others' size
before the MLP sync (``forward_batch_info.py`` ``_pad_inputs_to_size``), and on a CPU asks
the attention backend for the sequence length of the padding rows,
``get_cpu_graph_seq_len_fill_value()``. Only ``intel_amx`` has it (it answers 1), so on a
CPU without AMX ``enable_dp_attention`` died at the first batch: ``AttributeError:
'TorchNativeAttnBackend' object has no attribute 'get_cpu_graph_seq_len_fill_value'``.
The change gives ``torch_native`` the same answer; the rest of data-parallel attention
(the groups' schedulers, their all-gathers on gloo, the idle batches) is SGLang's code.

Each change is applied when its module is first imported, in every process of the
engine: this directory is first on ``PYTHONPATH`` (``tests/support/sglang_cpu.py``), so
Python imports this file at start-up. Production never sees it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

HANDLER_MODULE = "sglang.srt.models.deepseek_common.attention_backend_handler"
TORCH_NATIVE_MODULE = "sglang.srt.layers.attention.torch_native_backend"


def _register_torch_native(module: Any) -> None:
    def handle_attention_torch_native(attn: Any, forward_batch: Any) -> Any:
        return module._dispatch_mla_subtype(attn, forward_batch)

    module.AttentionBackendRegistry.register("torch_native", handle_attention_torch_native)


def _pad_like_intel_amx(module: Any) -> None:
    def get_cpu_graph_seq_len_fill_value(self: Any) -> int:
        return 1

    module.TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value = (
        get_cpu_graph_seq_len_fill_value
    )


PATCHES = {HANDLER_MODULE: _register_torch_native, TORCH_NATIVE_MODULE: _pad_like_intel_amx}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs the patch of a module right after SGLang's module executes."""

    def __init__(self, fullname: str) -> None:
        self.fullname = fullname

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.fullname:
            return None
        sys.meta_path.remove(self)
        patch = PATCHES[fullname]
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


for _name, _patch in PATCHES.items():
    if _name in sys.modules:
        _patch(sys.modules[_name])
    else:
        sys.meta_path.insert(0, _AfterImport(_name))
