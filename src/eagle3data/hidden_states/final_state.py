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
token's scale wherever the state is large against its epsilon). One case needs only a state
the norm maps back onto ``post``: a trainer whose teacher applies the plain RMSNorm
``x * rsqrt(mean(x^2) + eps) * w`` itself (vLLM speculators) takes
:meth:`PlainRmsNorm.prenorm_of` (``post / w`` is ``x`` up to a scale per token, which the
epsilon gives back where it still shows, and which the norm ignores where it does not).
:func:`plain_rms_norm` checks numerically that the target's norm is that formula and gives
``w`` and ``eps``; the speculators export and the draft check both go through it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ModelConfigError, ShardFormatError
from ..model_config import (
    decoder_key_mapping,
    decoder_tensor_name,
    read_model_config,
    rms_norm_eps,
)

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
# Rows of random input the plain-RMSNorm check feeds the target's final norm, per scale.
_NORM_PROBE_ROWS = 8
# The most a restored pre-norm state is scaled up by (m at 1 after rounding).
_LARGEST_SCALE = 1e6


# What everything written before ``final_state`` existed holds: shards, manifests and the
# hidden-state settings files (which leave the key out at this value, so an upgrade
# re-extracts nothing). The one place that says so: absent means this, nowhere else.
OLDER_FINAL_STATE = POST_NORM


def final_state_of(attrs: Mapping[str, Any], where: str | Path = "shard") -> str:
    """The final state a shard's attributes, a manifest's ``attrs`` or the hidden-state
    settings say it holds (absent: :data:`OLDER_FINAL_STATE`)."""
    value = attrs.get("final_state", OLDER_FINAL_STATE)
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
    from transformers import AutoModel, AutoModelForCausalLM

    from ..target import text_decoder_config
    from .checkpoint_tensors import read_tensor, weight_files

    config = text_decoder_config(model_path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
            decoder, under = model.get_decoder(), model
        except ValueError:  # a text config only its image-text model builds (Qwen2-VL's)
            decoder = AutoModel.from_config(config, trust_remote_code=trust_remote_code)
            model, under = decoder, None
    norm = getattr(decoder, "norm", None)
    if not isinstance(norm, torch.nn.Module):
        raise ModelConfigError(
            f"{model_path}: {type(model).__name__} has no final norm at .norm of its decoder; "
            f"cannot tell what its final state is"
        )
    # The decoder's names under a causal LM (``model.norm``), as the checkpoint's map to.
    prefix = (
        "model.norm"
        if under is None
        else next(name for name, module in under.named_modules() if module is norm)
    )
    wanted = {f"{prefix}.{name}": name for name in norm.state_dict()}
    files = weight_files(Path(model_path), "to read its final norm from")
    mapping = decoder_key_mapping(read_model_config(model_path))
    found: dict[str, torch.Tensor] = {}
    for stored in files:
        name = decoder_tensor_name(stored, mapping)
        if name in wanted:
            found[wanted[name]] = read_tensor(files[stored], stored)
    if set(found) != set(wanted.values()):
        missing = sorted(k for k, v in wanted.items() if v not in found)
        raise ModelConfigError(
            f"{model_path}: the checkpoint lacks {missing} of the final norm {type(norm).__name__}"
        )
    dtype = dtype or torch.float32
    norm = norm.to_empty(device="cpu")
    norm.load_state_dict(found)
    return FinalNorm(norm.to(dtype).eval(), str(model_path), dtype)


@dataclass(frozen=True)
class PlainRmsNorm:
    """A target's final norm, checked to be ``x * rsqrt(mean(x^2) + eps) * weight``."""

    weight: torch.Tensor  # float32 [H]
    eps: float
    model_path: str

    def prenorm_of(self, post: torch.Tensor) -> torch.Tensor:
        """The pre-norm state ([..., H], float32) this norm maps onto ``post``.

        ``post = w * x / sqrt(ms(x) + eps)``, so ``z = post / w`` is ``x`` scaled down by
        ``sqrt(ms(x) + eps)`` and its mean square ``m`` is ``ms(x) / (ms(x) + eps)``: the
        lost scale is ``sqrt(eps / (1 - m))``. Giving ``z`` alone (scale 1) is off by
        ``1 / sqrt(m + eps)`` after the norm: 1% where ``ms(x)`` is 46 epsilons, 9 times
        where it is under one. Where rounding of a stored ``post`` made ``m`` reach 1, no
        exact pre-image exists and a large scale is the nearest. A zero weight loses the
        channel and is refused."""
        import torch

        refuse_zero_weights(self.weight, self.model_path)
        z = post.float() / self.weight.float()
        if self.eps <= 0:  # scale-invariant: any positive scale is exact
            return z
        gap = (1.0 - z.pow(2).mean(-1, keepdim=True)).clamp(min=self.eps * _LARGEST_SCALE**-2)
        return z * torch.sqrt(self.eps / gap)


def plain_rms_norm(model_path: str | Path, *, trust_remote_code: bool = False) -> PlainRmsNorm:
    """The target's final norm when it is the plain RMSNorm
    ``x * rsqrt(mean(x^2) + eps) * w`` (what speculators' teacher applies); else a one-line
    :class:`ModelConfigError` naming the norm's class.

    Checked numerically on the module the target's own architecture builds, carrying the
    checkpoint's tensors (:func:`load_final_norm`): a class name cannot tell Gemma's
    ``(1 + w)`` from ``w``, and a wrapper's text decoder is found by its layout."""
    final = load_final_norm(model_path, trust_remote_code=trust_remote_code)
    tensors = final.module.state_dict()
    eps = rms_norm_eps(read_model_config(model_path))
    if set(tensors) != {"weight"} or eps is None or not _is_plain_rms(final.module, eps):
        raise ModelConfigError(
            f"{model_path}: the final norm is {final.class_name}, not an RMSNorm "
            f"x*rsqrt(mean(x^2)+eps)*w"
        )
    return PlainRmsNorm(tensors["weight"].detach().float(), float(eps), str(model_path))


def refuse_zero_weights(weight: torch.Tensor, model_path: str | Path) -> None:
    """One line when the final norm's ``weight`` has a zero: the pre-norm state is lost in
    that channel of a post-norm state."""
    zeros = int((weight == 0).sum())
    if zeros:
        raise ModelConfigError(
            f"{model_path}: the final norm has {zeros} zero weight(s): the pre-norm state is "
            f"lost in those channels of a post-norm state (extract with "
            f"hidden_states.final_state: pre_norm)"
        )


def _is_plain_rms(norm: torch.nn.Module, eps: float) -> bool:
    """Whether ``norm`` computes ``x * rsqrt(mean(x^2) + eps) * weight`` on random input of
    very different scales (a mean, bias or ``1 + w`` shows at every scale)."""
    import torch

    h = norm.weight.shape[-1]
    gen = torch.Generator().manual_seed(0)
    for scale in (1e-2, 1.0, 1e2):
        x = torch.randn(_NORM_PROBE_ROWS, h, generator=gen) * scale + 0.5 * scale
        with torch.no_grad():
            got = norm(x).float()
        want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm.weight
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-6):
            return False
    return True
