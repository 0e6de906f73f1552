"""The hidden_states job: one shard's conversations through the target, into HDF5.

:func:`extract_into_shard` is the loop: the shard's samples are declared to the writer
first, then computed in length-sorted batches packed to a token budget, and each batch's
states are written to their rows of the shard by a background thread while the next
batch is computed, so memory holds about two batches, never a whole shard.

Importing this module imports no torch: the job takes its GPUs first.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ValidationError
from ..images import ImageTable, pil_image
from ..layout import PROMPT_IMAGES, Results
from ..model_config import read_model_config, weights_quantization
from ..shards import ShardWriter
from ..tokenization.table import read_row_range
from . import final_state, fingerprint
from .backends import Extractor, build_extractor
from .planning import shard_spec
from .settings import CaptureSettings
from .shard_job import ShardJob

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image

# How conversations became samples (chat module docstring), for the people who train.
SAMPLES_ATTR = (
    "one sample per conversation; where the history a turn was generated on differs from "
    "the turns before it as produced (e.g. the template drops history reasoning), a new "
    "sample starts at that turn ({id}#{turn}, turn = message index of its first assistant "
    "turn): each sample is the prompt the target saw plus the turns it produced from there, "
    "and only those turns are supervised"
)

log = logging.getLogger(__name__)


# Padding is computed and thrown away. Once a batch holds this share of the token
# budget (enough to keep a GPU busy), a sample that would make more than
# _MAX_PADDING of it padding starts a new batch instead.
_MIN_FILL = 0.25
_MAX_PADDING = 0.1

# The backends that give a target its samples' images (docs/how-to/images.md): SGLang's CPU
# engine cannot serve an image-text target, so nothing could check its capture of one.
IMAGE_BACKENDS = ("transformers", "vllm")


def length_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Group sample indices, longest first, so padded tokens per batch stay
    within ``batch_tokens`` (a longer sample gets a batch of its own), and
    padding stays under 10% once a batch is a quarter full."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    real = 0  # real tokens in the last batch
    for i in order:
        if batches:
            # Sorted descending: the first member sets the padded width.
            padded = lengths[batches[-1][0]] * (len(batches[-1]) + 1)
            wasteful = real >= _MIN_FILL * batch_tokens and (
                padded - real - lengths[i] > _MAX_PADDING * padded
            )
            if padded <= batch_tokens and not wasteful:
                batches[-1].append(i)
                real += lengths[i]
                continue
        batches.append([i])
        real = lengths[i]
    return batches


# Batches whose states may wait for the writer thread: one being written while
# the next is computed. More only adds memory; the disk is not the bottleneck.
_WRITES_IN_FLIGHT = 1


def extract_into_shard(
    extractor: Extractor,
    writer: ShardWriter,
    sample_ids: Sequence[str],
    input_ids: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[int]],
    *,
    batch_tokens: int,
    background_writes: bool = True,
    on_batch: Callable[[int, int, int], None] | None = None,
    images: Callable[[int], list[Image]] | None = None,
) -> None:
    """Compute and store the hidden states of one shard's samples, in shard order.

    The samples are declared to ``writer`` first (ids, tokens, masks, offsets), then
    computed in length-sorted batches; each batch's rows go to their final offsets as
    soon as the batch is done. ``on_batch(n, of, samples_in_batch)`` reports progress;
    ``images(i)`` gives sample ``i``'s images (read per batch, never the shard's at once).
    """
    writer.declare_samples(sample_ids, input_ids, loss_masks)
    batches = length_batches([len(x) for x in input_ids], batch_tokens)

    def write(batch: list[int], states: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for i, (aux, last) in zip(batch, states, strict=True):
            writer.write_states(i, aux, last)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer") as pool:
        pending: deque[Future[None]] = deque()
        for n, batch in enumerate(batches, start=1):
            samples = [input_ids[i] for i in batch]
            if images is None:
                states = extractor.forward(samples)
            else:
                states = extractor.forward(samples, images=[images(i) for i in batch])
            if background_writes:
                pending.append(pool.submit(write, batch, states))
                while len(pending) > _WRITES_IN_FLIGHT:
                    pending.popleft().result()  # re-raises a failed write here
            else:
                write(batch, states)
            if on_batch is not None:
                on_batch(n, len(batches), len(batch))
        while pending:
            pending.popleft().result()


def extract_shard(
    job: ShardJob,
    capture: CaptureSettings,
    *,
    threads: int | None = None,
    extractor: Extractor | None = None,
) -> None:
    """Extract ``job``'s shard as its spec describes it. With ``extractor`` (a capture
    engine's, :mod:`.capture_service`) the target is not loaded here, and the extractor
    stays open for the next shard."""
    from ..torch_utils import dtype_name, set_threads

    dataset, shard, spec_path = job.dataset, job.shard, job.spec_path
    tokenized_path, tokenize_stats_path = job.tokenized_path, job.tokenize_stats_path
    spec = json.loads(Path(spec_path).read_text())
    df = read_row_range(tokenized_path, spec["start"], spec["end"])
    tok_stats = json.loads(Path(tokenize_stats_path).read_text())
    # The spec is what decides whether this shard is redone: never extract rows it
    # does not describe (it would be a bug upstream, so fail loudly).
    if spec != shard_spec(dataset, shard, spec["start"], spec["end"], df, tok_stats):
        raise ValidationError(
            f"{dataset} shard {shard}: {spec_path} does not describe rows "
            f"{spec['start']}-{spec['end']} of {tokenized_path}; re-run plan_shards "
            f"(snakemake -R plan_shards)"
        )
    owned = extractor is None
    if extractor is None:
        set_threads(threads)
        extractor = build_extractor(job.model_path, capture, job=f"{dataset}-{shard}")
    begin_shard = getattr(extractor, "begin_shard", None)
    if begin_shard is not None:  # a server backend names its requests after the shard
        begin_shard(f"{dataset}-{shard}")
    dtype = dtype_name(extractor.dtype)
    ids = df["id"].to_list()
    input_ids = df["input_ids"].to_list()
    masks = df["loss_mask"].to_list()
    attrs = {
        "dataset": dataset,
        "shard": shard,
        "model": job.model_label,
        "tokenizer_hash": tok_stats["tokenizer_hash"],
        "chat_template_hash": tok_stats["chat_template_hash"],
        "final_state": extractor.final_state,
        "final_state_description": final_state.DESCRIPTIONS[extractor.final_state],
        "max_seq_len": tok_stats["max_seq_len"],
        "reasoning": tok_stats["reasoning"],
        "samples": SAMPLES_ATTR,
        "compute_dtype": dtype,
        **extractor.aux.as_attrs(),
    }
    attrs[fingerprint.ATTR] = fingerprint.fingerprint_attr(
        {
            "weights_quantization": weights_quantization(read_model_config(job.model_path)),
            "aux_layer_ids": list(extractor.aux.layer_ids),
            "final_state": extractor.final_state,
            "compute_dtype": dtype,
            "tokenizer_hash": tok_stats["tokenizer_hash"],
            "chat_template_hash": tok_stats["chat_template_hash"],
            **extractor.capture_fingerprint(),
        }
    )

    def progress(n: int, of: int, conversations: int) -> None:
        log.info(
            "%s shard %d: batch %d/%d (%d conversations)", dataset, shard, n, of, conversations
        )

    sample_images = df["images"].to_list() if "images" in df.columns else []
    # Streams: each batch's rows are written at their offsets as the batch finishes.
    try:
        with (
            contextlib.ExitStack() as open_tables,
            ShardWriter(
                job.out_shard,
                hidden_size=extractor.hidden_size,
                hidden_dtype=dtype,
                attrs=attrs,
                compression=capture.compression,
                storage_dtype=capture.storage_dtype,
            ) as writer,
        ):
            images = _images_of(job, capture, sample_images, open_tables)
            extract_into_shard(
                extractor,
                writer,
                ids,
                input_ids,
                masks,
                batch_tokens=capture.batch_tokens,
                on_batch=progress,
                images=images,
            )
    finally:
        # Per-shard accounting (which ranks wrote the rows) goes to this shard's log.
        end_shard = getattr(extractor, "end_shard", None)
        if end_shard is not None:
            end_shard()
        # An engine backend stops its workers and frees what they hold here, while the
        # job's log still takes its lines (not at interpreter exit).
        close = getattr(extractor, "close", None)
        if owned and close is not None:
            close()
    log.info("%s shard %d: wrote %d conversations to %s", dataset, shard, len(ids), job.out_shard)


def _images_of(
    job: ShardJob,
    capture: CaptureSettings,
    sample_images: Sequence[Sequence[str]],
    open_tables: contextlib.ExitStack,
) -> Callable[[int], list[Image]] | None:
    """Sample ``i``'s images, read from the dataset's image table (open until
    ``open_tables`` closes: the shard's end) when asked; None for a
    shard of text samples."""
    if not any(sample_images):
        return None
    if capture.backend not in IMAGE_BACKENDS:
        raise ValidationError(
            f"{job.dataset} shard {job.shard}: samples with images are captured by "
            f"hidden_states.backend {' or '.join(IMAGE_BACKENDS)}, not {capture.backend} "
            f"(docs/how-to/images.md, 'What is verified')"
        )
    table = open_tables.enter_context(
        ImageTable(job.images_path or Results().path(PROMPT_IMAGES, dataset=job.dataset))
    )
    return lambda i: [pil_image(table.get(sha)) for sha in sample_images[i]]
