"""One function per workflow stage; the Snakemake scripts are thin calls to these.

Each stage reads its inputs, does its work through the library modules and
writes its declared outputs atomically, so a killed job leaves either the
previous state or the complete new one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import polars as pl

from .atomic import atomic_open, atomic_path, write_json, write_jsonl
from .generation import ErrorLimits, GenerationJob, Prompt, run_generation, write_outputs
from .preview import human_bytes
from .prompts import read_prompts, seeded_order
from .settings import (
    generation_key,
    generation_settings,
    hidden_state_dtype,
    model_fingerprint,
    model_name,
    sidecar_path,
)

log = logging.getLogger(__name__)

_MESSAGE = pl.Struct({"role": pl.String, "content": pl.String})


def setup_logging(log_path: str | None) -> None:
    """Log to the rule's log file (line-buffered) and to stderr."""
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


class ValidationError(RuntimeError):
    """Produced data failed a check; the message lists every problem."""


# Errors about the user's data or config, by module. Matched through sys.modules:
# an exception can only come from a module that is imported, and importing the rest
# (torch, transformers, h5py) on the way out would delay a stop by seconds.
_USER_ERRORS = {
    "eagle3data.chat": ("ChatTemplateError",),
    "eagle3data.engines.openai_engine": ("EngineUnavailable",),
    "eagle3data.generation": ("GenerationAborted",),
    "eagle3data.gpu_slots": ("GpuSlotError",),
    "eagle3data.journal": ("JournalCorruptError", "JournalLockedError"),
    "eagle3data.layers": ("AuxLayerError",),
    "eagle3data.prompts": ("PromptFormatError",),
    "eagle3data.shards": ("ShardFormatError",),
    "eagle3data.vocab": ("DraftVocabError",),
}


def is_user_error(exc: BaseException) -> bool:
    if isinstance(exc, DiskSpaceError | ValidationError | FileNotFoundError):
        return True
    return any(
        isinstance(exc, getattr(sys.modules[module], name))
        for module, names in _USER_ERRORS.items()
        if module in sys.modules
        for name in names
    )


def run_step(log_path: str | None, step: Callable[..., None], **kwargs: Any) -> None:
    """Run one stage from a Snakemake script.

    Problems with the user's data or config end the job with one clear line in
    its log (no traceback); anything else is a bug and keeps its traceback.
    """
    setup_logging(log_path)
    try:
        step(**kwargs)
    except Exception as exc:
        if is_user_error(exc):
            log.error("%s", exc)
        else:
            log.exception("%s failed", step.__name__)
        raise SystemExit(1) from None


# --- prompts ---------------------------------------------------------------


def prepare_prompts(
    *,
    dataset: str,
    source: str,
    fmt: str,
    on_invalid: str,
    shuffle_seed: int,
    out_prompts: str,
    out_skipped: str,
) -> None:
    parsed = read_prompts(source, fmt, on_invalid=on_invalid)  # type: ignore[arg-type]
    ordered = seeded_order(parsed.conversations, shuffle_seed)
    df = pl.DataFrame(
        {
            "index": list(range(len(ordered))),
            "id": [c.id for c in ordered],
            "prompt_hash": [c.prompt_hash for c in ordered],
            "source_line": [c.line for c in ordered],
            "messages": [c.messages for c in ordered],
        },
        schema={
            "index": pl.UInt32,
            "id": pl.String,
            "prompt_hash": pl.String,
            "source_line": pl.UInt32,
            "messages": pl.List(_MESSAGE),
        },
    )
    with atomic_path(out_prompts) as tmp:
        df.write_parquet(tmp)
    write_jsonl(out_skipped, [s.as_row() for s in parsed.skipped])
    log.info(
        "%s: %d conversations from %s (%d skipped, see %s)",
        dataset,
        len(ordered),
        source,
        len(parsed.skipped),
        out_skipped,
    )
    for s in parsed.skipped:
        log.warning("%s: skipped %s:%d: %s", dataset, s.file, s.line, s.reason)


def load_prompts(path: str) -> list[Prompt]:
    df = pl.read_parquet(path).sort("index")
    return [
        Prompt(row["id"], row["prompt_hash"], row["messages"]) for row in df.iter_rows(named=True)
    ]


# --- generate --------------------------------------------------------------


def generate(
    *,
    dataset: str,
    config: Mapping[str, Any],
    prompts_path: str,
    skipped_path: str,
    work_dir: str,
    out_responses: str,
    out_stats: str,
    out_errors: str,
    threads: int | None = None,
) -> None:
    ds_cfg = config["datasets"][dataset]
    gen_cfg = config["generation"]
    settings = generation_settings(config)
    key = generation_key(settings, model_fingerprint(config["model"]["path"]))
    journal = sidecar_path(work_dir, dataset, key)
    _describe_sidecar(journal, settings)
    job = GenerationJob(
        dataset=dataset,
        prompts=load_prompts(prompts_path),
        journal=journal,
        model=model_name(config["model"]),
        sampling=gen_cfg["sampling"],
        seed=gen_cfg["seed"],
        token_budget=ds_cfg.get("token_budget"),
        max_samples=ds_cfg.get("max_samples"),
        batch_size=gen_cfg["batch_size"],
        progress_interval_s=gen_cfg["progress_interval_s"],
    )

    if gen_cfg["backend"] == "openai":
        result = run_generation(
            job,
            lambda: _openai_engine(config),
            streaming=True,
            error_limits=ErrorLimits(
                max_consecutive_failures=gen_cfg["max_consecutive_failures"],
                max_error_rate=gen_cfg["max_error_rate"],
            ),
        )
    else:
        result = run_generation(job, lambda: _transformers_engine(config, threads))
    stats = dict(result.stats)
    stats["skipped_input"] = len(Path(skipped_path).read_text(encoding="utf-8").splitlines())
    stats["settings_key"] = key
    stats["backend"] = gen_cfg["backend"]
    write_outputs(result, Path(out_responses))
    write_jsonl(out_errors, result.failures)
    write_json(out_stats, stats)
    log.info(
        "%s: wrote %d responses, %d completion tokens (budget %s, stop: %s); "
        "accounting: %d prompts = %d in output + %d failed + %d beyond limits "
        "(+%d skipped as bad input); waste %d tokens",
        dataset,
        stats["in_output"],
        stats["completion_tokens"],
        stats["token_budget"],
        stats["stop_reason"],
        stats["prompts"],
        stats["in_output"],
        stats["failed"],
        stats["beyond_limits"],
        stats["skipped_input"],
        stats["waste_tokens"],
    )


def _transformers_engine(config: Mapping[str, Any], threads: int | None) -> Any:
    from .engines.transformers_engine import TransformersEngine
    from .torch_utils import set_threads

    set_threads(threads)
    return TransformersEngine(
        config["model"]["path"],
        sampling=config["generation"]["sampling"],
        chat_template_kwargs=config["model"]["chat_template_kwargs"],
        dtype=config["model"]["dtype"],
        device=config["generation"]["device"],
    )


def _openai_engine(config: Mapping[str, Any]) -> Any:
    import os

    from .engines.openai_engine import EngineUnavailable, HttpSettings, OpenAIEngine
    from .settings import served_model

    gen = config["generation"]
    api_key = None
    if gen["api_key_env"]:
        api_key = os.environ.get(gen["api_key_env"])
        if not api_key:
            raise EngineUnavailable(
                f"generation.api_key_env names {gen['api_key_env']!r}, which is not set"
            )
    settings = HttpSettings(
        endpoints=gen["endpoints"],
        model=served_model(config),
        concurrency=gen["concurrency"],
        api_key=api_key,
        request_timeout_s=gen["request_timeout_s"],
        max_retries=gen["max_retries"],
        extra_body=gen["extra_body"],
    )
    return OpenAIEngine(
        settings,
        sampling=gen["sampling"],
        seed=gen["seed"],
        chat_template_kwargs=config["model"]["chat_template_kwargs"],
        count_tokens=_lazy_token_counter(config["model"]["path"]),
    )


def _lazy_token_counter(model_path: str) -> Any:
    """Counts with the model's tokenizer, loaded only if a server omits usage."""
    tokenizer: list[Any] = []

    def count(text: str) -> int:
        if not tokenizer:
            from transformers import AutoTokenizer

            tokenizer.append(AutoTokenizer.from_pretrained(model_path, local_files_only=True))
        return len(tokenizer[0](text, add_special_tokens=False)["input_ids"])

    return count


def _describe_sidecar(journal: Path, settings: Mapping[str, Any]) -> None:
    """Write what a sidecar was made with next to it; say so when settings changed."""
    info = journal.with_suffix(".settings.json")
    others = sorted(p for p in journal.parent.glob("*.settings.json") if p != info)
    if not journal.exists() and others:
        log.warning(
            "generation settings differ from the %d earlier sidecar(s) in %s: starting a new "
            "sidecar %s (earlier progress is kept there, unused)",
            len(others),
            journal.parent,
            journal.name,
        )
    if not info.exists():
        write_json(info, dict(settings))


# --- tokenize --------------------------------------------------------------


def tokenize(
    *,
    dataset: str,
    responses_path: str,
    model_path: str,
    chat_template_kwargs: Mapping[str, Any],
    max_seq_len: int,
    out_tokenized: str,
    out_stats: str,
) -> None:
    from transformers import AutoTokenizer

    from .chat import chat_template_hash, tokenize_conversation, tokenizer_hash

    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    rows: dict[str, list[Any]] = {
        k: [] for k in ("index", "id", "input_ids", "loss_mask", "num_tokens", "truncated")
    }
    dropped = []
    n_in = 0
    with open(responses_path, encoding="utf-8") as fh:
        for line in fh:
            n_in += 1
            resp = json.loads(line)
            tok = tokenize_conversation(
                tokenizer,
                resp["messages"],
                chat_template_kwargs=chat_template_kwargs,
                max_seq_len=max_seq_len,
            )
            if tok.num_loss_tokens == 0:
                # Nothing for the draft to learn (e.g. the answer was truncated
                # away by max_seq_len); recorded, never silently lost.
                dropped.append(
                    {
                        "id": resp["id"],
                        "reason": f"no assistant token within max_seq_len={max_seq_len} "
                        f"(conversation has {tok.num_tokens_before_truncation} tokens)",
                    }
                )
                continue
            rows["index"].append(resp["index"])
            rows["id"].append(resp["id"])
            rows["input_ids"].append(tok.input_ids)
            rows["loss_mask"].append(tok.loss_mask)
            rows["num_tokens"].append(len(tok.input_ids))
            rows["truncated"].append(tok.num_tokens_before_truncation > len(tok.input_ids))
    df = pl.DataFrame(
        rows,
        schema={
            "index": pl.UInt32,
            "id": pl.String,
            "input_ids": pl.List(pl.Int32),
            "loss_mask": pl.List(pl.UInt8),
            "num_tokens": pl.UInt32,
            "truncated": pl.Boolean,
        },
    )
    with atomic_path(out_tokenized) as tmp:
        df.write_parquet(tmp)
    stats = {
        "dataset": dataset,
        "conversations_in": n_in,
        "conversations_out": df.height,
        "dropped": dropped,
        "tokens": int(df["num_tokens"].sum() or 0),
        "loss_tokens": int(df["loss_mask"].list.sum().sum() or 0),
        "truncated": int(df["truncated"].sum() or 0),
        "max_seq_len": max_seq_len,
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "chat_template_hash": chat_template_hash(tokenizer),
    }
    write_json(out_stats, stats)
    log.info(
        "%s: %d conversations, %d tokens (%d supervised), %d truncated, %d dropped",
        dataset,
        stats["conversations_out"],
        stats["tokens"],
        stats["loss_tokens"],
        stats["truncated"],
        len(dropped),
    )


# --- hidden states: plan, extract, validate ---------------------------------


SHARD_SPEC_COLUMNS = ["id", "num_tokens", "input_ids", "loss_mask"]


def shard_rows(tokenized_path: str | Path, start: int, end: int) -> pl.DataFrame:
    """Rows [start, end) of a tokenized dataset, reading only the row groups they are in."""
    lazy = pl.scan_parquet(tokenized_path).select(SHARD_SPEC_COLUMNS)
    return lazy.slice(start, end - start).collect()


def rows_digest(rows: pl.DataFrame) -> str:
    """What a shard's extraction reads from its rows, as one hash (ids, tokens, masks)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update("\0".join(rows["id"].to_list()).encode())
    digest.update(rows["num_tokens"].cast(pl.Int64).to_numpy().tobytes())
    for column, dtype in (("input_ids", pl.Int64), ("loss_mask", pl.Int8)):
        digest.update(rows[column].explode().cast(dtype).to_numpy().tobytes())
    return digest.hexdigest()


def shard_spec(
    dataset: str, shard: int, start: int, end: int, rows: pl.DataFrame, tok_stats: Mapping[str, Any]
) -> dict[str, Any]:
    """Everything a shard's extraction reads besides the model and ``hidden_states``
    settings (Snakemake tracks those): rewritten only when it changes, it is what
    makes a shard job re-run, so raising a budget extracts only new or changed shards."""
    return {
        "dataset": dataset,
        "shard": shard,
        "start": start,
        "end": end,
        "rows_digest": rows_digest(rows),
        **{key: tok_stats[key] for key in ("tokenizer_hash", "chat_template_hash", "max_seq_len")},
    }


def write_shard_specs(specs: list[dict[str, Any]], spec_dir: Path) -> int:
    """Write each spec whose content changed (an unchanged file keeps its mtime) and
    remove those of shards no longer planned. Returns how many were (re)written."""
    spec_dir.mkdir(parents=True, exist_ok=True)
    written = 0
    for spec in specs:
        path = spec_dir / f"shard-{spec['shard']:05d}.json"
        text = json.dumps(spec, indent=2, sort_keys=True) + "\n"
        if not path.exists() or path.read_text() != text:
            with atomic_open(path) as fh:
                fh.write(text)
            written += 1
    remove_unplanned(spec_dir, "json", len(specs))
    return written


def remove_unplanned(directory: Path, suffix: str, planned: int) -> list[str]:
    """Remove ``shard-NNNNN.<suffix>`` files numbered beyond the plan (after a lowered
    budget): left there, they are stale data for anything that lists the directory."""
    stale = [
        path
        for path in sorted(directory.glob(f"shard-*.{suffix}"))
        if path.stem[6:].isdigit() and int(path.stem[6:]) >= planned
    ]
    for path in stale:
        path.unlink()
    return [path.name for path in stale]


def plan_shards(
    *,
    dataset: str,
    tokenized_path: str,
    tokenize_stats_path: str,
    model_path: str,
    hidden_cfg: Mapping[str, Any],
    model_dtype: str,
    out_plan: str,
    spec_dir: str,
) -> None:
    from .settings import hidden_size, read_model_config, resolve_dtype_name
    from .shards import bytes_per_token

    model_config = read_model_config(model_path)
    dtype = resolve_dtype_name(hidden_state_dtype(hidden_cfg, model_dtype), model_config)
    width = hidden_size(model_config)
    per_token = bytes_per_token(width, dtype)
    rows = pl.read_parquet(tokenized_path, columns=SHARD_SPEC_COLUMNS)  # once: slices are views
    lengths = rows["num_tokens"].to_list()
    max_tokens = max(1, hidden_cfg["shard_bytes"] // per_token)
    shards: list[dict[str, int]] = []
    start = 0
    tokens = 0
    for i, n in enumerate(lengths):
        if i > start and tokens + n > max_tokens:
            shards.append({"start": start, "end": i, "tokens": tokens})
            start, tokens = i, 0
        tokens += n
    if start < len(lengths):
        shards.append({"start": start, "end": len(lengths), "tokens": tokens})
    total = sum(lengths)
    check_disk_space(dataset, Path(out_plan).parent, total * per_token)
    tok_stats = json.loads(Path(tokenize_stats_path).read_text())
    specs = [
        shard_spec(dataset, k, s["start"], s["end"], rows[s["start"] : s["end"]], tok_stats)
        for k, s in enumerate(shards)
    ]
    changed = write_shard_specs(specs, Path(spec_dir))
    removed = remove_unplanned(Path(out_plan).parent, "h5", len(shards))
    if removed:
        log.info("%s: removed %d shard(s) no longer planned: %s", dataset, len(removed), removed)
    log.info("%s: %d of %d shard(s) new or changed", dataset, changed, len(shards))
    write_json(
        out_plan,
        {
            "dataset": dataset,
            "hidden_dtype": dtype,
            "hidden_size": width,
            "bytes_per_token": per_token,
            "tokens": total,
            "estimated_bytes": total * per_token,
            "shards": [{"shard": k, **s} for k, s in enumerate(shards)],
        },
    )
    log.info(
        "%s: %d conversations, %d tokens -> %d shard(s), about %.1f MB of hidden states",
        dataset,
        len(lengths),
        total,
        len(shards),
        total * per_token / 1e6,
    )


class DiskSpaceError(RuntimeError):
    """The hidden states would not fit on the disk."""


def check_disk_space(dataset: str, shard_dir: Path, needed: int) -> None:
    """Fail before any forward pass when the shards cannot fit.

    Shards already in the directory are about to be replaced, so their bytes
    count as available.
    """
    shard_dir.mkdir(parents=True, exist_ok=True)
    replaced = sum(p.stat().st_size for p in shard_dir.glob("shard-*.h5"))
    free = shutil.disk_usage(shard_dir).free + replaced
    if needed > free:
        raise DiskSpaceError(
            f"{dataset}: the hidden states need about {human_bytes(needed)} but only "
            f"{human_bytes(free)} are free on {shard_dir}; free space, move results/ to a "
            "larger disk, or lower the token budget or hidden_states.max_seq_len"
        )


def extract_shard(
    *,
    dataset: str,
    shard: int,
    spec_path: str,
    tokenized_path: str,
    tokenize_stats_path: str,
    model_path: str,
    model_label: str,
    hidden_cfg: Mapping[str, Any],
    model_dtype: str,
    out_shard: str,
    threads: int | None = None,
) -> None:
    from .extract import extract_into_shard
    from .extractors import build_extractor
    from .shards import ShardWriter
    from .torch_utils import dtype_name, set_threads

    spec = json.loads(Path(spec_path).read_text())
    df = shard_rows(tokenized_path, spec["start"], spec["end"])
    tok_stats = json.loads(Path(tokenize_stats_path).read_text())
    # The spec is what decides whether this shard is redone: never extract rows it
    # does not describe (it would be a bug upstream, so fail loudly).
    if spec != shard_spec(dataset, shard, spec["start"], spec["end"], df, tok_stats):
        raise ValidationError(
            f"{dataset} shard {shard}: {spec_path} does not describe rows "
            f"{spec['start']}-{spec['end']} of {tokenized_path}; re-run plan_shards "
            f"(snakemake -R plan_shards)"
        )
    set_threads(threads)
    extractor = build_extractor(model_path, hidden_cfg, model_dtype)
    dtype = dtype_name(extractor.dtype)
    ids = df["id"].to_list()
    input_ids = df["input_ids"].to_list()
    masks = df["loss_mask"].to_list()
    attrs = {
        "dataset": dataset,
        "shard": shard,
        "model": model_label,
        "tokenizer_hash": tok_stats["tokenizer_hash"],
        "chat_template_hash": tok_stats["chat_template_hash"],
        "final_state": "post_norm",
        "final_state_description": "output of the model's final norm (the lm_head input)",
        "max_seq_len": tok_stats["max_seq_len"],
        "compute_dtype": dtype,
        **extractor.aux.as_attrs(),
    }

    def progress(n: int, of: int, conversations: int) -> None:
        log.info(
            "%s shard %d: batch %d/%d (%d conversations)", dataset, shard, n, of, conversations
        )

    # Streams: each batch's rows are written at their offsets as the batch finishes.
    with ShardWriter(
        out_shard,
        hidden_size=extractor.hidden_size,
        hidden_dtype=dtype,
        attrs=attrs,
        compression=hidden_cfg.get("compression", "none"),
    ) as writer:
        extract_into_shard(
            extractor,
            writer,
            ids,
            input_ids,
            masks,
            batch_tokens=hidden_cfg["batch_tokens"],
            on_batch=progress,
        )
    log.info("%s shard %d: wrote %d conversations to %s", dataset, shard, len(ids), out_shard)


def validate(
    *,
    dataset: str,
    responses_path: str,
    tokenized_path: str,
    tokenize_stats_path: str,
    plan_path: str,
    shard_paths: list[str],
    out_manifest: str,
) -> None:
    from .shards import open_shard, validate_shard

    plan = json.loads(Path(plan_path).read_text())
    tok_stats = json.loads(Path(tokenize_stats_path).read_text())
    tokenized = pl.read_parquet(tokenized_path, columns=["id"])["id"].to_list()
    with open(responses_path, encoding="utf-8") as fh:
        response_ids = [json.loads(line)["id"] for line in fh]
    dropped = {d["id"] for d in tok_stats["dropped"]}
    errors: list[str] = []
    if [i for i in response_ids if i not in dropped] != tokenized:
        errors.append(
            f"{tokenized_path}: ids differ from {responses_path} minus the "
            f"{len(dropped)} conversations dropped at tokenization"
        )
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
    if errors:
        raise ValidationError(
            f"{dataset}: {len(errors)} problem(s) found:\n" + "\n".join(f"  - {e}" for e in errors)
        )
    attrs: dict[str, Any] = {}
    if shard_paths:  # a dataset can be empty (e.g. token_budget 0): no shards, still valid
        with open_shard(shard_paths[0]) as first:
            skip = ("shard", "num_samples", "num_tokens")
            attrs = {k: v for k, v in first.attrs.items() if k not in skip}
    manifest = {
        "dataset": dataset,
        "num_shards": len(shards),
        "num_samples": sum(s["samples"] for s in shards),
        "num_tokens": sum(s["tokens"] for s in shards),
        "num_loss_tokens": tok_stats["loss_tokens"],
        "bytes": sum(Path(p).stat().st_size for p in shard_paths),
        "shards": shards,
        "checks": [
            "format name and version",
            "dataset shapes and dtypes against attributes",
            "offsets start at 0, strictly increase, end at the token count",
            "all hidden states finite",
            "every sample has at least one loss token",
            "ids unique and equal to the planned slice of the tokenized data",
            "tokenized ids equal the response ids minus recorded drops",
        ],
        "attrs": _jsonable(attrs),
    }
    write_json(out_manifest, manifest)
    log.info(
        "%s: %d shards, %d samples, %d tokens validated",
        dataset,
        manifest["num_shards"],
        manifest["num_samples"],
        manifest["num_tokens"],
    )


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return obj
