"""vLLM's ``ExampleHiddenStatesConnector`` for vLLM's CPU engine (the test suite).

Loaded by the vLLM server, not by the tests: ``--kv-transfer-config`` names it with
``kv_connector_module_path: eagle3data_cpu_hidden_states`` and this folder is on the
server's ``PYTHONPATH`` (``support.vllm_server.VLLMServer(capture=...)``). It imports
nothing but vLLM, torch and safetensors, which the server's environment has.

Why a subclass: the stock connector copies the states out of the KV cache with CUDA
streams, CUDA events and pinned memory, which kill vLLM 0.32's CPU engine at the first
request. This one copies and writes synchronously in the worker. Everything else is the
stock connector's: which requests are saved (all of them), the file name
(``{shared_storage_path}/{request id}.safetensors``), the ``.lock`` file the reader waits
on, ``hidden_states`` ``[T, layers, H]`` and ``token_ids``. The file is written under a
temporary name and renamed, so no reader ever sees part of it.
"""

from __future__ import annotations

import fcntl
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
)


class _Written:
    """Stands for the stock connector's CUDA event: the copy is done when it exists."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        # The request's cache slots, block by block, in token order.
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + offsets[None, :]).flatten()
        num_tokens = pending.token_ids.shape[0]
        block_size = self._kv_cache.shape[2]
        states = self._kv_cache[slots // block_size, :, slots % block_size][:num_tokens]
        tensors = {"hidden_states": states.clone(), "token_ids": pending.token_ids.clone()}
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            partial = pending.filename + ".partial"
            save_file(tensors, partial)
            os.replace(partial, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the reader
        self._req_copy_events[pending.req_id] = _Written()
