"""The files vLLM's hidden-state connector writes: read one once it is whole, delete one.

vLLM's ``ExampleHiddenStatesConnector`` (and its subclasses) writes
``{shared_storage_path}/{request id}.safetensors`` in a writer thread after the request
has been answered, holding an exclusive ``flock`` on ``{path}.lock`` from before the answer
until the file is written. Readers take a shared lock on it first (vLLM's own
``load_hidden_states`` does the same); this module imports neither vLLM nor torch until
a file is read, so the generate stage can delete the files of a capture server it
generates with.
"""

from __future__ import annotations

import fcntl
import os
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch


def read_states(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a file the connector wrote, once it is whole: the connector holds
    an exclusive lock on ``{path}.lock`` until it has written the file."""
    from safetensors.torch import load_file

    lock = path + ".lock"
    try:
        with open(lock) as held:
            fcntl.flock(held, fcntl.LOCK_SH)  # sleeps until the writer lets go
            return load_file(path, device="cpu")
    except FileNotFoundError:
        if not os.path.exists(path):
            raise
        return load_file(path, device="cpu")


Discarded = Literal["deleted", "absent", "forbidden"]


def discard_states(path: str) -> Discarded:
    """Delete a file the connector wrote and its lock, once the write is over (deleting
    it while the writer is still at it would leave the file behind). Says what happened:
    ``deleted``; ``absent`` (neither the file nor its lock is here: the server's storage
    is not this machine's, or someone deleted it first); ``forbidden`` (this user may not
    delete it: a server running as another user, e.g. root in a container)."""
    lock = path + ".lock"
    try:
        try:
            with open(lock) as held:
                fcntl.flock(held, fcntl.LOCK_SH)
                deleted = _unlink(path)
            _unlink(lock)
        except FileNotFoundError:
            deleted = _unlink(path)
    except PermissionError:
        return "forbidden"
    return "deleted" if deleted else "absent"


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
