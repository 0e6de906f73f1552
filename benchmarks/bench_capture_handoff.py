"""SGLang capture, host side: captured states -> shard on disk, at Kimi-K2.5's width.

    .venv/bin/python benchmarks/bench_capture_handoff.py           # about 2 min on 2 cores
    .venv/bin/python benchmarks/bench_capture_handoff.py --gib 0.25 --rounds 1

What runs is the workflow's own code (``SGLangCapture`` + ``extract_into_shard`` +
``ShardWriter``, the shard fsynced and renamed) with the GPU replaced by a worker
process that stands in for SGLang's scheduler: it is started with ``spawn`` as SGLang
starts its schedulers, resolves our ``forward_hooks`` spec the way SGLang's hook manager
does, runs the hook on each forward batch's ``[T, 3H]`` aux and ``[T, H]`` final-norm
rows (bfloat16, hidden size 7168), slices the result per request and ``.tolist()``s it
(``_append_prefill_hidden_states``), and pickles the results back through a pipe
(SGLang's ZMQ hops). Side by side, interleaved round by round:

(tensor) ``handoff: shared_memory``: the hook copies rows into /dev/shm, only pointers
         travel; our process maps the rows and the shard writer reads them from there.
(lists)  ``handoff: lists``: SGLang's stock path, states as Python floats; on a few
         hundred tokens only (it is ~100x slower).
(dd)     ``dd if=/dev/zero bs=1M conv=fdatasync`` of the same size on the shard's disk.

Reported: MiB/s of hidden-state bytes (tokens x 4H x 2 B) and tokens/s, and the ratio
tensor / dd (the issue's goal: >= 0.8). The states in the last tensor-path shard are
then compared with what the worker produced, row by row.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from importlib import import_module
from multiprocessing.connection import Connection
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

# The same dd measurement as the extraction benchmark (this script's folder is on sys.path).
from bench_hidden_states import dd_write  # noqa: E402

from eagle3data.hidden_states.extraction import extract_into_shard, length_batches  # noqa: E402
from eagle3data.hidden_states.sglang_capture import SGLangCapture  # noqa: E402
from eagle3data.shards import ShardWriter, open_shard  # noqa: E402

KIMI_HIDDEN = 7168
KIMI_CONFIG = {
    # Kimi-K2.5's text decoder as SGLang sees it (notes/kimi.md): width and depth matter here.
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": KIMI_HIDDEN,
    "num_hidden_layers": 61,
    "torch_dtype": "bfloat16",
}
SEED = 1234


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0, help="hidden-state GiB per tensor-path run")
    p.add_argument("--list-tokens", type=int, default=512, help="tokens per list-path run")
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=3, help="interleaved repetitions")
    p.add_argument("--dir", type=Path, default=REPO / "results", help="scratch dir (its disk)")
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    return p.parse_args()


# ------------------------------------------------------------ the stand-in scheduler


def batch_rows(tokens: int, width: int) -> torch.Tensor:
    """The rows a forward batch of ``tokens`` produces: a fixed seeded block, so the
    parent can tell what each stored row must be."""
    generator = torch.Generator().manual_seed(SEED)
    return torch.randn((tokens, width), generator=generator).to(torch.bfloat16)


def serve(conn: Connection, spec: Mapping[str, Any], hidden: int, max_tokens: int) -> None:
    """One SGLang scheduler, as far as the capture can tell: run our hook per forward
    batch, return each request's slice of ``output.hidden_states`` as lists."""
    module, attr = spec["hook_factory"].split(":")
    hook = getattr(import_module(module), attr)(spec.get("config") or {})
    block = batch_rows(max_tokens, 4 * hidden)
    while (lengths := conn.recv()) is not None:
        total = sum(lengths)
        rows = block[:total] if total <= max_tokens else batch_rows(total, 4 * hidden)
        output = SimpleNamespace(
            hidden_states=rows[:, : 3 * hidden], last_hidden_states=rows[:, 3 * hidden :]
        )
        hook(None, (), output)
        results, start = [], 0
        for length in lengths:
            part = output.hidden_states[start : start + length].clone().tolist()
            start += length
            results.append(
                {
                    "output_ids": [0],
                    "meta_info": {
                        "prompt_tokens": length,
                        "cached_tokens": 0,
                        "hidden_states": [part],
                    },
                }
            )
        conn.send(results)
    conn.close()


class WorkerEngine:
    """What ``SGLangCapture`` needs from ``sglang.Engine``, backed by :func:`serve`."""

    def __init__(self, kwargs: Mapping[str, Any], max_tokens: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        (spec,) = kwargs["forward_hooks"]
        self.process = context.Process(
            target=serve, args=(child, spec, KIMI_HIDDEN, max_tokens), daemon=True
        )
        self.process.start()
        child.close()

    def generate(self, *, input_ids: Sequence[Sequence[int]], **_: Any) -> list[dict[str, Any]]:
        self.conn.send([len(ids) for ids in input_ids])
        return self.conn.recv()

    def shutdown(self) -> None:
        self.conn.send(None)
        self.process.join(timeout=30)


# ------------------------------------------------------------------------ runs


def workload(total_tokens: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Conversations of seeded lengths (200..3000 tokens) adding up to ``total_tokens``."""
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while sum(lengths) < total_tokens:
        lengths.append(int(min(rng.integers(200, 3000), total_tokens - sum(lengths))))
    input_ids = [rng.integers(0, 163_840, n).tolist() for n in lengths]
    return input_ids, [[1] * n for n in lengths]


def capture_into_shard(
    capture: SGLangCapture,
    path: Path,
    input_ids: list[list[int]],
    masks: list[list[int]],
    batch_tokens: int,
) -> float:
    """Seconds from the first forward to the shard fsynced and renamed."""
    path.unlink(missing_ok=True)
    start = time.perf_counter()
    with ShardWriter(
        path, hidden_size=KIMI_HIDDEN, hidden_dtype="bfloat16", attrs={"model": "bench"}
    ) as writer:
        extract_into_shard(
            capture,
            writer,
            [f"s{i}" for i in range(len(input_ids))],
            input_ids,
            masks,
            batch_tokens=batch_tokens,
        )
    return time.perf_counter() - start


def check_shard(path: Path, input_ids: list[list[int]], batch_tokens: int) -> None:
    """Every stored row is the row the worker produced for that token."""
    lengths = [len(x) for x in input_ids]
    with open_shard(path) as shard:
        for batch in length_batches(lengths, batch_tokens):
            rows = batch_rows(sum(lengths[i] for i in batch), 4 * KIMI_HIDDEN)
            start = 0
            for i in batch:
                expected = rows[start : start + lengths[i]]
                start += lengths[i]
                rows_i = slice(int(shard.sample_offsets[i]), int(shard.sample_offsets[i + 1]))
                stored = torch.cat(
                    [
                        shard.aux_hidden_states(rows_i, as_torch=True),
                        shard.last_hidden_states(rows_i, as_torch=True),
                    ],
                    dim=-1,
                )
                if not torch.equal(stored, expected):
                    raise SystemExit(f"sample {i}: stored states differ from the captured ones")


def make_capture(model_dir: Path, handoff: str, batch_tokens: int) -> SGLangCapture:
    return SGLangCapture(
        str(model_dir),
        options={"handoff": handoff},
        batch_tokens=batch_tokens,
        engine_factory=lambda kwargs: WorkerEngine(kwargs, batch_tokens),
    )


def main() -> None:
    args = parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".bench-handoff-", dir=args.dir))
    try:
        report = run(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


def run(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    model_dir = scratch / "kimi-shaped"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(KIMI_CONFIG))
    token_bytes = 4 * KIMI_HIDDEN * 2
    big_ids, big_masks = workload(int(args.gib * 2**30 / token_bytes), seed=1)
    small_ids, small_masks = workload(args.list_tokens, seed=2)
    big_tokens = sum(map(len, big_ids))
    mib = big_tokens * token_bytes / 2**20
    print(
        f"{big_tokens} tokens ({mib:,.0f} MiB of bf16 states at H={KIMI_HIDDEN}) per tensor "
        f"run, {args.list_tokens} per list run, batch_tokens {args.batch_tokens}, "
        f"{args.rounds} rounds, scratch {scratch}",
        flush=True,
    )
    tensor_capture = make_capture(model_dir, "shared_memory", args.batch_tokens)
    list_capture = make_capture(model_dir, "lists", args.batch_tokens)
    try:
        # Warm-up: worker start, imports, first mappings.
        capture_into_shard(
            tensor_capture, scratch / "warm.h5", small_ids, small_masks, args.batch_tokens
        )
        capture_into_shard(
            list_capture, scratch / "warm.h5", small_ids, small_masks, args.batch_tokens
        )
        tensor_s, list_s, dd_s = [], [], []
        for r in range(args.rounds):
            tensor_s.append(
                capture_into_shard(
                    tensor_capture, scratch / "tensor.h5", big_ids, big_masks, args.batch_tokens
                )
            )
            list_s.append(
                capture_into_shard(
                    list_capture, scratch / "lists.h5", small_ids, small_masks, args.batch_tokens
                )
            )
            dd_s.append(dd_write(scratch / "dd.bin", round(mib)))
            print(
                f"round {r + 1}: tensor {tensor_s[-1]:.2f} s, lists {list_s[-1]:.2f} s, "
                f"dd {dd_s[-1]:.2f} s",
                flush=True,
            )
        check_shard(scratch / "tensor.h5", big_ids, args.batch_tokens)
    finally:
        tensor_capture.close()
        list_capture.close()
    tensor_t, list_t, dd_t = (statistics.median(x) for x in (tensor_s, list_s, dd_s))
    list_tokens = sum(map(len, small_ids))
    return {
        "hidden_size": KIMI_HIDDEN,
        "tensor_tokens": big_tokens,
        "list_tokens": list_tokens,
        "rounds": args.rounds,
        "tensor_mib_s": mib / tensor_t,
        "tensor_tokens_s": big_tokens / tensor_t,
        "list_mib_s": list_tokens * token_bytes / 2**20 / list_t,
        "list_tokens_s": list_tokens / list_t,
        "dd_mib_s": mib / dd_t,
        "tensor_over_dd": dd_t / tensor_t,
        "tensor_over_lists": (big_tokens / tensor_t) / (list_tokens / list_t),
        "rows_checked": True,
    }


def print_table(r: Mapping[str, Any]) -> None:
    rows = [
        ("tensor (shared_memory hand-off)", f"{r['tensor_mib_s']:,.0f}", r["tensor_tokens_s"]),
        ("lists (SGLang's return_hidden_states)", f"{r['list_mib_s']:,.1f}", r["list_tokens_s"]),
    ]
    print("\n| path | MiB/s | tokens/s |\n|---|---:|---:|")
    for name, mib_s, tokens_s in rows:
        print(f"| {name} | {mib_s} | {tokens_s:,.0f} |")
    print(f"| dd conv=fdatasync | {r['dd_mib_s']:,.0f} | |\n")
    print(
        f"tensor / dd: {r['tensor_over_dd']:.2f} (goal >= 0.8); "
        f"tensor / lists: {r['tensor_over_lists']:.0f}x"
    )


if __name__ == "__main__":
    main()
