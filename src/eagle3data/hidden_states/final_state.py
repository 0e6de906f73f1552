"""Which final state a shard holds, and the target's own final norm between the two.

A shard's ``last_hidden_states`` is one of:

* ``pre_norm``: the last decoder layer's output, the state the model's final norm is
  applied to (what vLLM's extraction captures and speculators trains on);
* ``post_norm``: the final norm's output, the lm_head input (what SpecForge's
  ``TargetHead`` and the agreement check project).

The ``final_state`` attribute says which (shards written before ``pre_norm`` existed say
``post_norm``). Post-norm is a function of pre-norm: :class:`FinalNorm` is the norm module
the target's own architecture builds, carrying the checkpoint's weights, so applying it
to a pre-norm state gives what the target computed, for any norm class (RMSNorm, Gemma's
``1 + w``, LayerNorm). The inverse does not exist in general (a plain RMSNorm loses each
token's scale; see :mod:`eagle3data.consumers.speculators` for the one case where a
trainer does not need it).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ModelConfigError, ShardFormatError
from ..model_config import is_wrapper, read_model_config

if TYPE_CHECKING:  # torch is imported where a norm is built: the job takes its GPUs first
    import torch

PRE_NORM = "pre_norm"
POST_NORM = "post_norm"
FINAL_STATES = (PRE_NORM, POST_NORM)
DESCRIPTIONS = {
    PRE_NORM: "output of the last decoder layer, before the model's final norm (the state "
    "the final norm is applied to)",
    POST_NORM: "output of the model's final norm (the lm_head input)",
}


def final_state_of(attrs: Mapping[str, Any], where: str | Path = "shard") -> str:
    """The final state a shard's attributes (or a manifest's ``attrs``) say it holds."""
    value = attrs.get("final_state", POST_NORM)
    if value not in FINAL_STATES:
        raise ShardFormatError(
            f"{where}: final_state {value!r} is none of {list(FINAL_STATES)}; not a shard "
            f"this version can read"
        )
    return str(value)


@dataclass
class FinalNorm:
    """The target's final norm on the CPU: ``norm(pre)`` is the post-norm state."""

    module: torch.nn.Module
    model_path: str
    dtype: torch.dtype

    @property
    def class_name(self) -> str:
        return type(self.module).__name__

    def to(self, dtype: torch.dtype) -> FinalNorm:
        """This norm computing in ``dtype``: the forward dtype of the states it is given,
        so that the result is what the target computed in that dtype."""
        if dtype == self.dtype:
            return self
        return FinalNorm(copy.deepcopy(self.module).to(dtype), self.model_path, dtype)

    def __call__(self, pre: torch.Tensor) -> torch.Tensor:
        """The post-norm state of ``pre`` ([..., H]), in ``pre``'s dtype."""
        import torch

        with torch.no_grad():
            return self.module(pre.to(self.dtype)).to(pre.dtype)


def load_final_norm(
    model_path: str | Path, *, dtype: torch.dtype | None = None, trust_remote_code: bool = False
) -> FinalNorm:
    """The final norm of ``model_path``'s text decoder (``model.norm`` of its architecture,
    built on the meta device: no other weight is read), with the checkpoint's tensors, in
    ``dtype`` (float32 by default)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..target import _WRAPPER_KEY_MAPPING, text_decoder_config
    from .agreement import _read_tensor, _weight_files

    config = text_decoder_config(model_path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    norm = getattr(model.get_decoder(), "norm", None)
    if not isinstance(norm, torch.nn.Module):
        raise ModelConfigError(
            f"{model_path}: {type(model).__name__} has no final norm at .norm of its decoder; "
            f"cannot tell what its final state is"
        )
    prefix = next(name for name, module in model.named_modules() if module is norm)
    wanted = {f"{prefix}.{name}": name for name in norm.state_dict()}
    files = _weight_files(Path(model_path))
    mapping = _WRAPPER_KEY_MAPPING if is_wrapper(read_model_config(model_path)) else {}
    found: dict[str, torch.Tensor] = {}
    for stored in files:
        name = stored
        for pattern, replacement in mapping.items():
            name = re.sub(pattern, replacement, name)
        if name in wanted:
            found[wanted[name]] = _read_tensor(files[stored], stored)
    if set(found) != set(wanted.values()):
        missing = sorted(k for k, v in wanted.items() if v not in found)
        raise ModelConfigError(
            f"{model_path}: the checkpoint lacks {missing} of the final norm {type(norm).__name__}"
        )
    dtype = dtype or torch.float32
    norm = norm.to_empty(device="cpu")
    norm.load_state_dict(found)
    return FinalNorm(norm.to(dtype).eval(), str(model_path), dtype)
