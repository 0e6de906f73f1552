"""The validate job: check every shard of a dataset against the plan and the tokenized
data, and write ``manifest.json`` (what training code trusts) only if all is well."""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from .. import model_config
from ..atomic import write_json
from ..errors import ValidationError
from ..schema import from_schema
from ..shards import open_shard, validate_shard
from ..tokenization.settings import TokenizeSettings
from ..tokenization.table import sample_id_of
from . import agreement, fingerprint
from .final_state import PRE_NORM, FinalNorm, final_state_of, load_final_norm
from .layers import AuxLayerError, resolve_aux_layers
from .response_masks import SampledResponse, response_mask_errors

log = logging.getLogger(__name__)

CHECKS = [
    "format name and version",
    "every shard captured the same way (capture fingerprint)",
    "dataset shapes and dtypes against attributes",
    "offsets start at 0, strictly increase, end at the token count",
    "all hidden states finite",
    "float8 storage: one finite, positive float32 scale per token per block",
    "every sample has at least one loss token",
    "ids unique and equal to the planned slice of the tokenized data",
    "tokenized samples are the responses in order, each trained (whole or per assistant "
    "turn) or recorded as dropped",
    "aux layer ids and layer count as the config's rule gives them for the model",
    "a seeded sample of responses, made into samples again from scratch (from the engine's "
    "token ids, else re-rendered and re-tokenized), equals the shards' token ids and loss masks",
    "the same responses against the shards without that code: each sample's supervised tokens "
    "are the completion ids the response row stores for its turns, in order, and decode to "
    "the turns' reasoning and content (rows without ids: the supervised tokens' text holds "
    "the assistant turns' text, in order)",
]
AGREEMENT_CHECK = (
    "the target agrees with the tokens it generated: lm_head(last state at t) predicts the "
    "token at t + 1 (greedy: agreement; sampled: log-probability), well above a "
    "one-token-shifted control"
)


def sample_id_errors(
    rows: pl.DataFrame, response_ids: list[str], dropped: list[dict[str, Any]]
) -> list[str]:
    """Check that the tokenized samples are the responses, in order, each response
    either trained (as one sample or one per assistant turn) or recorded as dropped."""
    errors: list[str] = []
    ids = rows["id"].to_list()
    if len(set(ids)) != len(ids):
        errors.append("sample ids are not unique")
    indices = rows["index"].to_list()
    if indices != sorted(indices):
        errors.append("samples are not in response order")
    for index, sample_id, turn in rows.iter_rows():
        if not 0 <= index < len(response_ids):
            errors.append(f"sample {sample_id!r} names response index {index}, which is absent")
            break
        # Whole conversation, or one of its samples split at a break (tokenization.table).
        one, per_turn = (sample_id_of(response_ids[index], turn, n) for n in (1, 2))
        if sample_id not in (one, per_turn):
            errors.append(f"sample {sample_id!r} does not belong to response {index}")
            break
    covered = set(indices) | {d.get("index") for d in dropped}
    missing = [i for i in range(len(response_ids)) if i not in covered]
    if missing:
        errors.append(
            f"{len(missing)} response(s) neither tokenized nor recorded as dropped "
            f"(first: {response_ids[missing[0]]!r})"
        )
    return errors


def aux_layer_errors(
    attrs: Mapping[str, Any], spec: str | Sequence[int], convention: str, num_layers: int
) -> list[str]:
    """The aux layers a shard records against what the config's rule gives for the
    model's depth (the agreement check cannot see them: it reads only the last state)."""
    try:
        expected = resolve_aux_layers(spec, num_layers, convention).as_attrs()  # type: ignore[arg-type]
    except AuxLayerError as exc:
        return [f"hidden_states.aux_layers: {exc}"]
    wrong = {
        key: (attrs.get(key), value)
        for key, value in expected.items()
        if _jsonable(attrs.get(key)) != value
    }
    return [
        f"{key} is {got}, the config's rule gives {want} for this {num_layers}-layer model"
        for key, (got, want) in wrong.items()
    ]


@dataclass
class _Responses:
    ids: list[str]
    greedy: bool  # every response generated at temperature 0
    turns: dict[str, list[agreement.TurnRecord]]


def _read_responses(responses_path: str) -> _Responses:
    out = _Responses([], True, {})
    with open(responses_path, encoding="utf-8") as fh:
        for line in fh:
            record = json.loads(line)
            out.ids.append(record["id"])
            out.greedy &= not float(record.get("sampling", {}).get("temperature", 0.0))
            out.turns[record["id"]] = agreement.turn_records(record)
    return out


def sampled_responses(responses_path: str, count: int, seed: int = 0) -> list[SampledResponse]:
    """A seeded sample of ``count`` response rows, in file order (streamed: responses can
    be GBs)."""
    import numpy as np

    with open(responses_path, "rb") as fh:
        total = sum(1 for _ in fh)
    if not total or count <= 0:
        return []
    picked = np.random.default_rng(seed).choice(total, min(count, total), replace=False)
    chosen = set(picked.tolist())
    with open(responses_path, encoding="utf-8") as fh:
        lines = {n: line for n, line in enumerate(fh) if n in chosen}
    return [
        SampledResponse(json.loads(lines[n]), f"{responses_path}:{n + 1}") for n in sorted(lines)
    ]


def response_sample_errors(
    responses_path: str,
    shard_paths: Sequence[str],
    *,
    model_path: str,
    tokenize: TokenizeSettings,
    trust_remote_code: bool,
    count: int,
    dropped_ids: Collection[str] = (),
    seed: int = 0,
) -> list[str]:
    """The checks of a seeded sample of ``count`` responses against the shards: made into
    samples again (:func:`retokenize_errors`) and, without the code that made them, the
    supervised tokens against the rows (:mod:`.response_masks`; ``dropped_ids``: the
    samples the tokenize stage recorded as dropped)."""
    from ..target import load_tokenizer

    responses = sampled_responses(responses_path, count, seed)
    if not responses:
        return []
    tokenizer = load_tokenizer(model_path, trust_remote_code=trust_remote_code)
    image_token = model_config.image_token_id(model_config.read_model_config(model_path))
    return [
        *_retokenized_errors(tokenizer, responses, shard_paths, tokenize, image_token),
        *response_mask_errors(
            tokenizer,
            responses,
            shard_paths,
            **tokenize.render_options(),
            dropped_ids=dropped_ids,
        ),
    ]


def retokenize_errors(
    responses_path: str,
    shard_paths: Sequence[str],
    *,
    model_path: str,
    tokenize: TokenizeSettings,
    trust_remote_code: bool,
    count: int,
    seed: int = 0,
) -> list[str]:
    """Make a seeded sample of ``count`` responses into samples again from scratch
    (:func:`..tokenization.samples.tokenize_response`: the engine's token ids, else the
    chat module's re-render; the target's tokenizer, the tokenize settings) and compare each
    sample with what the shards hold: the check of the token ids (a stale or foreign
    tokenization) and of the loss mask, which the agreement check cannot see (a mask
    shifted by one token still selects tokens the target predicts well). It re-runs the
    code it checks: :mod:`.response_masks` checks the masks without it."""
    from ..target import load_tokenizer

    responses = sampled_responses(responses_path, count, seed)
    if not responses:
        return []
    tokenizer = load_tokenizer(model_path, trust_remote_code=trust_remote_code)
    image_token = model_config.image_token_id(model_config.read_model_config(model_path))
    return _retokenized_errors(tokenizer, responses, shard_paths, tokenize, image_token)


def _retokenized_errors(
    tokenizer: Any,
    responses: Sequence[SampledResponse],
    shard_paths: Sequence[str],
    tokenize: TokenizeSettings,
    image_token: int | None = None,
) -> list[str]:
    from ..tokenization.samples import tokenize_response

    # sample id -> (where it comes from, what tokenize_response gives for it, from what)
    expected: dict[str, tuple[str, list[int], list[int], str]] = {}
    for response in responses:
        made = tokenize_response(
            tokenizer,
            response.row,
            **tokenize.render_options(),
            image_token=image_token,
        )
        samples = made.samples
        for tok in samples:
            if tok.num_loss_tokens:  # else dropped at tokenize time (recorded there)
                sid = sample_id_of(response.row["id"], tok.turn, len(samples))
                expected[sid] = (response.origin, tok.input_ids, tok.loss_mask, made.source)
    errors: list[str] = []
    for path in shard_paths:
        with open_shard(path) as shard:
            for i, sid in enumerate(shard.sample_ids):
                if sid not in expected:
                    continue
                origin, want_ids, want_mask, source = expected.pop(sid)
                rows = slice(int(shard.sample_offsets[i]), int(shard.sample_offsets[i + 1]))
                where = f"{path} sample {sid!r} ({origin})"
                if shard.input_ids[rows].tolist() != want_ids and source == "engine_ids":
                    errors.append(
                        f"{where}: its token ids are not the engine's token ids recorded in "
                        f"the response (tokenized from another responses file?)"
                    )
                elif shard.input_ids[rows].tolist() != want_ids:
                    errors.append(
                        f"{where}: its token ids are not what the target's tokenizer gives "
                        f"for the chat template's render of the response (compare the shard "
                        f"attributes tokenizer_hash/chat_template_hash with model.path's)"
                    )
                elif (mask := shard.loss_mask[rows].tolist()) != want_mask:
                    errors.append(f"{where}: {_mask_difference(mask, want_mask)}")
    missing = ((sid, origin) for sid, (origin, *_) in expected.items())
    errors.extend(f"{origin}: sample {sid!r} is in no shard" for sid, origin in missing)
    return errors


def _mask_difference(stored: list[int], expected: list[int]) -> str:
    diff = [j for j, (a, b) in enumerate(zip(stored, expected, strict=True)) if a != b]
    for shift in (1, -1, 2, -2):
        moved = ([0] * shift + expected)[: len(expected)] if shift > 0 else expected[-shift:]
        moved = moved + [0] * (len(expected) - len(moved))
        if moved == stored:
            return (
                f"the loss mask is the chat template's shifted by {shift:+d} token(s) "
                f"({len(diff)} positions differ, first at token {diff[0]})"
            )
    return (
        f"the loss mask differs from the chat template's at {len(diff)} positions (first at "
        f"token {diff[0]}: stored {stored[diff[0]]}, expected {expected[diff[0]]})"
    )


def check_agreement(
    dataset: str,
    shard_paths: Sequence[str],
    model_path: str,
    settings: agreement.AgreementSettings,
    responses: _Responses,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """The agreement section of the manifest; raises when it fails the thresholds."""
    greedy = responses.greedy
    head = agreement.load_head(model_path)
    norm: FinalNorm | None = None
    if shard_paths:
        with open_shard(shard_paths[0]) as first:
            if final_state_of(first.attrs, first.path) == PRE_NORM:
                norm = load_final_norm(model_path, trust_remote_code=trust_remote_code)
    end_of_turn = agreement.end_of_turn_ids(model_path)
    total = agreement.AgreementStats()
    per_shard = []
    count = settings.positions_per_shard
    for k, path in enumerate(shard_paths):
        with open_shard(path) as shard:
            stats = agreement.shard_agreement(
                shard,
                head,
                end_of_turn,
                None if count == "all" else int(count),
                seed=k,
                turns=responses.turns,
                final_norm=norm,
            )
        total = total.combine(stats)
        per_shard.append({"file": Path(path).name, **stats.summary()})
    summary = total.summary()
    section = {
        **summary,
        "greedy": greedy,
        "judged_by": "agreement" if greedy else "mean_logprob",
        "end_of_turn_ids": sorted(end_of_turn),
        "settings": settings.to_json(),
        "shards": per_shard,
    }
    log.info(
        "%s agreement %s (control %s), mean log-prob %s (control %s) over %d positions, %s",
        dataset,
        summary["agreement"],
        summary["control_agreement"],
        summary["mean_logprob"],
        summary["control_mean_logprob"],
        summary["positions"],
        "greedy" if greedy else "sampled",
    )
    problems = agreement.judge(summary, greedy=greedy, settings=settings)
    if problems:
        for entry in per_shard:
            log.error("%s %s", dataset, entry)
        raise ValidationError(agreement.failure_message(dataset, summary, problems))
    return section


@dataclass(frozen=True)
class ValidationSettings:
    """What the validate job checks, parsed once from its rule's ``params.checks``; built
    by hand, the schema's defaults and no re-tokenizing (no ``tokenize`` settings)."""

    aux_layers: str | tuple[int, ...] = from_schema("hidden_states", "aux_layers")
    aux_layer_convention: str = from_schema("hidden_states", "aux_layer_convention")
    agreement: agreement.AgreementSettings = field(default_factory=agreement.AgreementSettings)
    tokenize: TokenizeSettings | None = None
    retokenize_samples: int = from_schema("validate", "retokenize_samples")
    trust_remote_code: bool = from_schema("model", "trust_remote_code")

    @classmethod
    def parse(cls, checks: Mapping[str, Any]) -> ValidationSettings:
        layers = checks["aux_layers"]
        return cls(
            aux_layers=layers if isinstance(layers, str) else tuple(layers),
            aux_layer_convention=checks["aux_layer_convention"],
            agreement=agreement.AgreementSettings.parse(checks["agreement"]),
            tokenize=TokenizeSettings.parse(checks["tokenize"]),
            retokenize_samples=int(checks["retokenize_samples"]),
            trust_remote_code=bool(checks["trust_remote_code"]),
        )


def validate(
    *,
    dataset: str,
    responses_path: str,
    tokenized_path: str,
    tokenize_stats_path: str,
    plan_path: str,
    shard_paths: list[str],
    out_manifest: str,
    model_path: str | None = None,
    settings: ValidationSettings | None = None,
) -> None:
    """Check the dataset's shards. With ``model_path`` (the target) also: the aux layers
    against the rule, the agreement check and a sample of responses made into samples
    again (``settings``; None: the schema's defaults, nothing re-tokenized)."""
    wanted = settings or ValidationSettings()
    plan = json.loads(Path(plan_path).read_text())
    tok_stats = json.loads(Path(tokenize_stats_path).read_text())
    rows = pl.read_parquet(tokenized_path, columns=["index", "id", "turn"])
    tokenized = rows["id"].to_list()
    responses = _read_responses(responses_path)
    response_ids = responses.ids
    errors = sample_id_errors(rows, response_ids, tok_stats["dropped"])
    errors = [f"{tokenized_path}: {e} (responses: {responses_path})" for e in errors]
    if len(shard_paths) != len(plan["shards"]):
        errors.append(f"expected {len(plan['shards'])} shards, got {len(shard_paths)}")
    shards = []
    for entry, path in zip(plan["shards"], shard_paths, strict=False):
        expected = tokenized[entry["start"] : entry["end"]]
        check = validate_shard(path, expected_ids=expected, hidden_size=plan["hidden_size"])
        errors.extend(check.errors)
        shards.append(
            {
                "file": Path(path).name,
                "samples": check.num_samples,
                "tokens": check.num_tokens,
                "sha256": check.sha256,
            }
        )
    attrs: dict[str, Any] = {}
    captured: dict[str, Any] | None = None
    image_token = (  # None: not an image-text target
        None
        if model_path is None
        else model_config.image_token_id(model_config.read_model_config(model_path))
    )
    images = ImageTokens(0, [])  # a dataset can be empty (e.g. token_budget 0)
    if shard_paths and not errors:
        every_attrs = _shard_attrs(shard_paths)
        errors.extend(fingerprint.mixed_fingerprint_errors(every_attrs))
        first = fingerprint.first_fingerprint(every_attrs)
        captured = None if first is None else first[1]
    if shard_paths and not errors:  # a dataset can be empty (e.g. token_budget 0)
        with open_shard(shard_paths[0]) as first:
            skip = ("shard", "num_samples", "num_tokens")
            attrs = {k: v for k, v in first.attrs.items() if k not in skip}
        if model_path is not None:
            depth = model_config.num_hidden_layers(model_config.read_model_config(model_path))
            errors.extend(
                f"{shard_paths[0]}: {e}"
                for e in aux_layer_errors(
                    attrs, wanted.aux_layers, wanted.aux_layer_convention, depth
                )
            )
        if image_token is not None:
            images = image_tokens(shard_paths, image_token)
            errors.extend(images.errors)
        if model_path is not None and wanted.tokenize is not None and wanted.retokenize_samples:
            errors.extend(
                response_sample_errors(
                    responses_path,
                    shard_paths,
                    model_path=model_path,
                    tokenize=wanted.tokenize,
                    trust_remote_code=wanted.trust_remote_code,
                    count=wanted.retokenize_samples,
                    dropped_ids={str(d.get("id")) for d in tok_stats["dropped"]},
                )
            )
    if errors:
        raise ValidationError(
            f"{dataset}: {len(errors)} problem(s) found:\n" + "\n".join(f"  - {e}" for e in errors)
        )
    checks = list(CHECKS)
    agreement_section: dict[str, Any] | None = None
    if model_path is not None and wanted.agreement.enabled:
        agreement_section = check_agreement(
            dataset, shard_paths, model_path, wanted.agreement, responses, wanted.trust_remote_code
        )
        checks.append(AGREEMENT_CHECK)
    manifest = {
        "dataset": dataset,
        "num_shards": len(shards),
        "num_samples": sum(s["samples"] for s in shards),
        "num_tokens": sum(s["tokens"] for s in shards),
        "num_loss_tokens": tok_stats["loss_tokens"],
        # How the samples were made: from the engine's token ids, and how many of those
        # turns the chat template re-renders identically (absent in older stats).
        "token_ids": tok_stats.get("token_ids"),
        "bytes": sum(Path(p).stat().st_size for p in shard_paths),
        "shards": shards,
        "checks": checks,
        "attrs": _jsonable(attrs),
        # What made the states (every shard's that has one is the same: checked above);
        # None when every shard was written before it existed.
        "capture_fingerprint": captured,
        # None: the check was off (validate.agreement.enabled: false).
        "agreement": agreement_section,
    }
    if image_token is not None:  # an image-text target: how many tokens are images' (no loss)
        manifest["num_image_tokens"] = images.count
    write_json(out_manifest, manifest)
    log.info(
        "%s: %d shards, %d samples, %d tokens validated",
        dataset,
        manifest["num_shards"],
        manifest["num_samples"],
        manifest["num_tokens"],
    )


def _shard_attrs(shard_paths: Sequence[str]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in shard_paths:
        with open_shard(path) as shard:
            out.append((path, dict(shard.attrs)))
    return out


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return obj


@dataclass(frozen=True)
class ImageTokens:
    """A dataset's image tokens, read in one pass over its shards."""

    count: int  # the manifest's num_image_tokens
    # Samples whose loss mask covers an image token: images are the target's input, never
    # what it produced, so a draft must not be trained to predict them (checked here on
    # its own, not only through the re-tokenized sample, which covers a seeded few).
    errors: list[str]


def image_tokens(shard_paths: Sequence[str], image_token: int) -> ImageTokens:
    count = 0
    errors = []
    for path in shard_paths:
        with open_shard(path) as shard:
            is_image = shard.input_ids == image_token
            count += int(is_image.sum())
            rows = np.flatnonzero(is_image & (shard.loss_mask != 0))
            samples = np.searchsorted(shard.sample_offsets, rows, side="right") - 1
            for i in np.unique(samples)[:5]:
                errors.append(
                    f"{path}: sample {shard.sample_ids[i]}: {int((samples == i).sum())} image "
                    f"token(s) (id {image_token}) in the loss mask; images are the target's "
                    f"input, never supervised"
                )
    return ImageTokens(count, errors)
