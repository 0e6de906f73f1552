"""What one hidden_states job captures. A module of its own, importing nothing heavy: a shard
job that hands its shard to a capture engine (:mod:`.capture_service`) needs this and no
polars, h5py or torch, whose imports cost a CPU-bound capture more than the hand-off."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardJob:
    """One hidden_states job: which shard of which dataset, read from which files (the
    plan's spec, the tokenized rows and their stats), written where, by which target."""

    dataset: str
    shard: int
    spec_path: str
    tokenized_path: str
    tokenize_stats_path: str
    out_shard: str
    model_path: str
    model_label: str  # provenance only (the shards' ``model`` attribute)
    # The dataset's image table; None: where the workflow's layout has it (the job runs in
    # the workflow's directory).
    images_path: str | None = None
