"""Hidden-state extraction: throughput against its ceiling, peers, the disk; storage cost.

    .venv/bin/python benchmarks/bench_hidden_states.py            # a few minutes on 2 cores
    .venv/bin/python benchmarks/bench_hidden_states.py --samples 8 --rounds 1 --write-mb 256

Everything is measured side by side in one run, interleaved round by round, and
reported as ratios (absolute numbers on shared machines are noise):

(a) extraction tokens/s of the code the workflow runs (``HiddenStateExtractor`` +
    ``extract_into_shard`` + ``ShardWriter``, file fsynced and renamed) divided by a
    bare forward of the base model (separately loaded, no hooks) on the same batches:
    the ceiling. Also with the writes inline (no writer thread).
(b) the same samples done the peers' way (ModelOpt ``compute_hidden_states_hf.py``,
    SpecForge's HF backend): batch of one, the full causal LM with
    ``output_hidden_states=True``, one ``torch.save`` file per sample.
(c) HDF5 write MB/s of a large shard (rows written in the length-sorted batch order
    of a real job) divided by ``dd conv=fdatasync`` on the same disk.
(d) bytes on disk per token divided by the ideal 4*H*dtype + 4 (int32 id) + 1 (mask).
Then compression (none/lzf/gzip) on the real hidden states of (a), as float32 and bf16.

The workload is real text (this repository's README and sources) tokenized by the
model, cut into ``--samples`` conversations of seeded lengths; the model is the demo
SmolLM2-135M-Instruct (``--model`` for another local directory).
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from eagle3data import layout  # noqa: E402
from eagle3data.hidden_states.extraction import (  # noqa: E402
    extract_into_shard,
    length_batches,
)
from eagle3data.hidden_states.transformers_capture import HiddenStateExtractor  # noqa: E402
from eagle3data.shards import ShardWriter, bytes_per_token  # noqa: E402
from eagle3data.target import load_causal_lm  # noqa: E402
from eagle3data.torch_utils import dtype_name  # noqa: E402

DEMO_MODEL = REPO / layout.DEMO_MODEL


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="local HF model dir (default: demo)")
    p.add_argument("--dtype", default="float32", help="compute/storage dtype (CPU: float32)")
    p.add_argument("--samples", type=int, default=6)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--batch-tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5, help="interleaved repetitions of (a), (b)")
    p.add_argument("--inline", action="store_true", help="also time (a) without the writer thread")
    p.add_argument("--write-mb", type=int, default=1024, help="size of the shard for (c)")
    p.add_argument("--dir", type=Path, default=REPO / "results", help="scratch dir (its disk)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    return p.parse_args()


def demo_model_dir(scratch: Path) -> Path:
    if DEMO_MODEL.joinpath("config.json").exists():
        return DEMO_MODEL
    from eagle3data.demo_model import convert_gguf, find_demo_gguf

    out = scratch / "SmolLM2-135M-Instruct"
    convert_gguf(find_demo_gguf(), out)
    return out


def workload(tokenizer: Any, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    text = (REPO / "README.md").read_text()
    text += "".join(p.read_text() for p in sorted((REPO / "src").rglob("*.py")))
    stream = tokenizer(text, add_special_tokens=False)["input_ids"]
    rng = np.random.default_rng(seed)
    lengths = rng.integers(lo, hi + 1, size=n)
    starts = rng.integers(0, len(stream) - hi, size=n)
    return [stream[s : s + k] for s, k in zip(starts.tolist(), lengths.tolist(), strict=True)]


def padded(samples: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch tensors HiddenStateExtractor.forward builds."""
    width = max(len(s) for s in samples)
    ids = torch.full((len(samples), width), pad, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[row, : len(s)] = 1
    return ids, mask


# CPU seconds (all threads of this process) of the last timed() call: on a shared
# machine wall time mostly measures the neighbours; CPU time measures the work done.
last_cpu_s = [0.0]


def timed(fn: Callable[[], Any]) -> float:
    start, start_cpu = time.perf_counter(), time.process_time()
    fn()
    last_cpu_s[0] = time.process_time() - start_cpu
    return time.perf_counter() - start


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# --------------------------------------------------------------------------- (a), (b)


def run_bare(base: Any, batches: list[list[int]], samples: list[list[int]], pad: int) -> None:
    with torch.inference_mode():
        for batch in batches:
            ids, mask = padded([samples[i] for i in batch], pad)
            base(input_ids=ids, attention_mask=mask, use_cache=False)


def run_ours(
    extractor: HiddenStateExtractor,
    path: Path,
    samples: list[list[int]],
    batch_tokens: int,
    background: bool,
    compression: str = "none",
) -> None:
    ids = [f"s{i:05d}" for i in range(len(samples))]
    masks = [[0] * (len(s) // 2) + [1] * (len(s) - len(s) // 2) for s in samples]
    with ShardWriter(
        path,
        hidden_size=extractor.hidden_size,
        hidden_dtype=dtype_name(extractor.dtype),  # type: ignore[arg-type]
        attrs={"model": "bench"},
        compression=compression,
    ) as writer:
        extract_into_shard(
            extractor,
            writer,
            ids,
            samples,
            masks,
            batch_tokens=batch_tokens,
            background_writes=background,
        )


def run_peer(model: Any, out_dir: Path, samples: list[list[int]], aux_indices: Sequence[int]):
    """ModelOpt compute_hidden_states_hf.py / SpecForge HF: batch 1, all hidden states, lm_head."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        for i, s in enumerate(samples):
            ids = torch.tensor([s], dtype=torch.long)
            out = model(input_ids=ids, output_hidden_states=True)
            aux = torch.cat([out.hidden_states[k] for k in aux_indices], dim=-1)
            n = len(s)
            torch.save(
                {
                    "input_ids": ids[0],
                    "loss_mask": torch.tensor([0] * (n // 2) + [1] * (n - n // 2)),
                    "hidden_states": out.hidden_states[-1][0].clone(),
                    "aux_hidden_states": aux[0].clone(),
                },
                out_dir / f"s{i:05d}.pt",
            )


# --------------------------------------------------------------------------- (c)


def dd_write(path: Path, megabytes: int) -> float:
    """Seconds for dd to write and fdatasync ``megabytes`` MiB."""
    start = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={megabytes}", "conv=fdatasync"],
        check=True,
        capture_output=True,
    )
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed


def synthetic_shard(
    path: Path,
    megabytes: int,
    hidden: int,
    dtype: str,
    lengths: Sequence[int],
    batch_tokens: int,
    compression: str = "none",
) -> tuple[float, int, int]:
    """Write a shard of about ``megabytes`` MiB the way a job does (length-sorted batches,
    rows at their offsets). Returns (seconds incl. fsync + rename, tokens, logical bytes)."""
    per_token = bytes_per_token(hidden, dtype)
    all_lengths: list[int] = []
    while sum(all_lengths) * per_token < megabytes << 20:
        all_lengths.extend(lengths)
    n, longest = len(all_lengths), max(all_lengths)
    gen = torch.Generator().manual_seed(0)
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype, torch.float32)
    aux = (torch.randn(longest, 3 * hidden, generator=gen)).to(torch_dtype)
    last = (torch.randn(longest, hidden, generator=gen)).to(torch_dtype)
    batches = length_batches(all_lengths, batch_tokens)
    start = time.perf_counter()
    with ShardWriter(
        path,
        hidden_size=hidden,
        hidden_dtype=dtype,  # type: ignore[arg-type]
        attrs={},
        compression=compression,
    ) as w:
        w.declare_samples(
            [f"s{i}" for i in range(n)],
            [np.ones(k, dtype=np.int32) for k in all_lengths],
            [np.ones(k, dtype=np.uint8) for k in all_lengths],
        )
        for batch in batches:
            for i in batch:
                k = all_lengths[i]
                w.write_states(i, aux[:k], last[:k])
    elapsed = time.perf_counter() - start
    tokens = sum(all_lengths)
    return elapsed, tokens, tokens * per_token


# --------------------------------------------------------------------------- compression


def compression_table(shard: Path, scratch: Path, batch_tokens: int) -> list[dict[str, Any]]:
    """Re-store the real hidden states of ``shard`` with each filter, as f32 and bf16."""
    with h5py.File(shard, "r") as f:
        offsets = f["sample_offsets"][()]
        ids = f["input_ids"][()]
        aux_all = torch.from_numpy(f["aux_hidden_states"][()])
        last_all = torch.from_numpy(f["last_hidden_states"][()])
    hidden = last_all.shape[1]
    lengths = np.diff(offsets).tolist()
    batches = length_batches(lengths, batch_tokens)
    rows = []
    for dtype in ("float32", "bfloat16"):
        td = torch.float32 if dtype == "float32" else torch.bfloat16
        aux_d, last_d = aux_all.to(td), last_all.to(td)
        logical = len(ids) * bytes_per_token(hidden, dtype)
        for compression in ("none", "lzf", "gzip"):
            path = scratch / f"c-{dtype}-{compression}.h5"
            start = time.perf_counter()
            with ShardWriter(
                path,
                hidden_size=hidden,
                hidden_dtype=dtype,  # type: ignore[arg-type]
                attrs={},
                compression=compression,
            ) as w:
                w.declare_samples(
                    [f"s{i}" for i in range(len(lengths))],
                    [ids[offsets[i] : offsets[i + 1]] for i in range(len(lengths))],
                    [np.ones(k, dtype=np.uint8) for k in lengths],
                )
                for batch in batches:
                    for i in batch:
                        rows_i = slice(int(offsets[i]), int(offsets[i + 1]))
                        w.write_states(i, aux_d[rows_i], last_d[rows_i])
            write_s = time.perf_counter() - start
            size = path.stat().st_size
            read_s = timed(lambda p=path: _read_all(p))
            path.unlink()
            # The same rows appended in shard order: no chunk is ever written twice.
            with ShardWriter(
                path,
                hidden_size=hidden,
                hidden_dtype=dtype,  # type: ignore[arg-type]
                attrs={},
                compression=compression,
            ) as w:
                for i, k in enumerate(lengths):
                    rows_i = slice(int(offsets[i]), int(offsets[i + 1]))
                    w.add(
                        f"s{i}",
                        ids[rows_i],
                        np.ones(k, dtype=np.uint8),
                        aux_d[rows_i],
                        last_d[rows_i],
                    )
            rows.append(
                {
                    "dtype": dtype,
                    "compression": compression,
                    "ratio": size / logical,
                    "ratio_appended": path.stat().st_size / logical,
                    "write_mb_s": logical / write_s / 1e6,
                    "read_mb_s": logical / read_s / 1e6,
                }
            )
            path.unlink()
        # An upper bound for any general-purpose codec (zstd, blosc): xz on byte-shuffled states.
        sample = aux_d[: min(len(ids), 4096)].contiguous()
        raw = sample.view(torch.uint8).numpy() if dtype == "float32" else _bytes_of(sample)
        shuffled = raw.reshape(-1, sample.element_size()).T.copy().tobytes()
        rows.append(
            {
                "dtype": dtype,
                "compression": "xz -6, byte-shuffled (bound, not offered)",
                "ratio": len(lzma.compress(shuffled, preset=6)) / len(shuffled),
                "ratio_appended": float("nan"),
                "write_mb_s": float("nan"),
                "read_mb_s": float("nan"),
            }
        )
    return rows


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint8)


def _read_all(path: Path) -> None:
    with h5py.File(path, "r") as f:
        f["aux_hidden_states"][()]
        f["last_hidden_states"][()]


# --------------------------------------------------------------------------- main


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".bench-hidden-", dir=args.dir))
    try:
        report = run(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


def run(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    model_dir = args.model or demo_model_dir(scratch)
    extractor = HiddenStateExtractor(str(model_dir), dtype=args.dtype, device="cpu")
    plain, _ = load_causal_lm(
        model_dir, dtype=args.dtype, device="cpu", trust_remote_code=False
    )  # no hooks
    bare = plain.get_decoder()
    pad = extractor.tokenizer.pad_token_id or 0
    samples = workload(extractor.tokenizer, args.samples, args.min_len, args.max_len)
    tokens = sum(len(s) for s in samples)
    lengths = [len(s) for s in samples]
    batches = length_batches(lengths, args.batch_tokens)
    padded_tokens = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    dtype = dtype_name(extractor.dtype)
    hidden = extractor.hidden_size
    print(
        f"model {model_dir.name} ({dtype}, H={hidden}), {len(samples)} samples, {tokens} tokens "
        f"in {len(batches)} batches ({padded_tokens / tokens:.3f} padded/real), "
        f"torch threads {torch.get_num_threads()}, scratch {scratch}",
        flush=True,
    )

    # Warm up every path once (allocators, kernels, page cache for the weights).
    warm = samples[:2]
    run_bare(bare, [[0, 1]], warm, pad)
    run_ours(extractor, scratch / "warm.h5", warm, args.batch_tokens, True)
    run_peer(plain, scratch / "warm-peer", warm, extractor.aux.hidden_states_indices)

    times: dict[str, list[float]] = {"bare": [], "ours": [], "peer": []}
    if args.inline:
        times["ours_inline"] = []
    ours_path = scratch / "ours.h5"
    aux_indices = extractor.aux.hidden_states_indices
    peer_dir = scratch / "peer"
    names = list(times)
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        # Interleaved, the order reversed every round: the load of a shared machine drifts,
        # and each round's ratios compare runs that were next to each other in time.
        for name in names if r % 2 == 0 else names[::-1]:
            if name == "bare":
                t = timed(lambda: run_bare(bare, batches, samples, pad))
            elif name == "peer":
                shutil.rmtree(peer_dir, ignore_errors=True)
                t = timed(lambda: run_peer(plain, peer_dir, samples, aux_indices))
            else:
                inline = name == "ours_inline"
                t = timed(
                    lambda inline=inline: run_ours(
                        extractor, ours_path, samples, args.batch_tokens, not inline
                    )
                )
            times[name].append(t)
            cpu[name].append(last_cpu_s[0])
            print(
                f"round {r + 1} {name:12s} {t:7.2f} s  {tokens / t:8.1f} tokens/s  "
                f"cpu {last_cpu_s[0]:7.2f} s",
                flush=True,
            )

    med = {k: statistics.median(v) for k, v in times.items()}

    def per_round(slower: str, faster: str, t: dict[str, list[float]] = times) -> list[float]:
        return [a / b for a, b in zip(t[slower], t[faster], strict=True)]

    ideal = bytes_per_token(hidden, dtype)
    ours_bytes = ours_path.stat().st_size
    ours_blocks = os.stat(ours_path).st_blocks * 512
    peer_bytes = dir_bytes(peer_dir)

    # (c): disk ceiling and our writer, interleaved.
    dd_s, h5_s = [], []
    h5_tokens = h5_logical = 0
    big = scratch / "big.h5"
    for _ in range(2):
        dd_s.append(dd_write(scratch / "dd.bin", args.write_mb))
        s, h5_tokens, h5_logical = synthetic_shard(
            big, args.write_mb, hidden, dtype, lengths, args.batch_tokens
        )
        h5_s.append(s)
        big_bytes = big.stat().st_size
        big.unlink()
    dd_mb_s = args.write_mb * (1 << 20) / statistics.median(dd_s) / 1e6
    h5_mb_s = h5_logical / statistics.median(h5_s) / 1e6

    comp = compression_table(ours_path, scratch, args.batch_tokens)

    report = {
        "model": model_dir.name,
        "dtype": dtype,
        "hidden_size": hidden,
        "samples": len(samples),
        "tokens": tokens,
        "batches": len(batches),
        "padded_over_real": padded_tokens / tokens,
        "torch_threads": torch.get_num_threads(),
        "seconds": times,
        "tokens_per_s": {k: tokens / v for k, v in med.items()},
        "a_ours_over_bare": statistics.median(per_round("bare", "ours")),
        "a_per_round": per_round("bare", "ours"),
        "a_of_fastest_runs": min(times["bare"]) / min(times["ours"]),
        "a_cpu_time": statistics.median(per_round("bare", "ours", cpu)),
        "a_cpu_per_round": per_round("bare", "ours", cpu),
        "a_inline_over_bare": (
            statistics.median(per_round("bare", "ours_inline")) if args.inline else None
        ),
        "b_speedup_over_peer": statistics.median(per_round("peer", "ours")),
        "b_per_round": per_round("peer", "ours"),
        "b_of_fastest_runs": min(times["peer"]) / min(times["ours"]),
        "b_cpu_time": statistics.median(per_round("peer", "ours", cpu)),
        "b_cpu_per_round": per_round("peer", "ours", cpu),
        "cpu_seconds": cpu,
        "c_dd_mb_s": dd_mb_s,
        "c_hdf5_mb_s": h5_mb_s,
        "c_hdf5_over_dd": h5_mb_s / dd_mb_s,
        "c_shard_tokens": h5_tokens,
        "d_ideal_bytes_per_token": ideal,
        "d_ours_over_ideal": ours_bytes / (tokens * ideal),
        "d_ours_allocated_over_ideal": ours_blocks / (tokens * ideal),
        "d_big_shard_over_ideal": big_bytes / h5_logical,
        "d_peer_over_ideal": peer_bytes / (tokens * ideal),
        "compression": comp,
    }
    print_report(report)
    return report


def print_report(r: dict[str, Any]) -> None:
    tps = r["tokens_per_s"]
    print()
    print("| measure | value | target |")
    print("|---|---|---|")
    print(f"| bare forward (ceiling), tokens/s | {tps['bare']:.1f} | |")
    print(f"| ours (extract_into_shard + ShardWriter), tokens/s | {tps['ours']:.1f} | |")
    rounds_a = ", ".join(f"{x:.2f}" for x in r["a_per_round"])
    rounds_b = ", ".join(f"{x:.2f}" for x in r["b_per_round"])
    print(
        f"| (a) ours / bare forward, median of rounds ({rounds_a}) | "
        f"{r['a_ours_over_bare']:.3f} | >= 0.9 |"
    )
    print(f"| (a) same, fastest run of each | {r['a_of_fastest_runs']:.3f} | |")
    rounds_cpu = ", ".join(f"{x:.2f}" for x in r["a_cpu_per_round"])
    print(f"| (a) same in CPU seconds, median of rounds ({rounds_cpu}) | {r['a_cpu_time']:.3f} | |")
    if r["a_inline_over_bare"] is not None:
        print(f"| (a') ours, writes inline / bare forward | {r['a_inline_over_bare']:.3f} | |")
    print(
        f"| peers' way (batch 1, lm_head, torch.save per sample), tokens/s | {tps['peer']:.1f} | |"
    )
    print(
        f"| (b) ours / peers' way, median of rounds ({rounds_b}) | "
        f"{r['b_speedup_over_peer']:.2f}x | |"
    )
    print(f"| (b) same, fastest run of each | {r['b_of_fastest_runs']:.2f}x | |")
    rounds_cpu = ", ".join(f"{x:.2f}" for x in r["b_cpu_per_round"])
    print(
        f"| (b) same in CPU seconds, median of rounds ({rounds_cpu}) | {r['b_cpu_time']:.2f}x | |"
    )
    print(f"| dd conv=fdatasync, MB/s | {r['c_dd_mb_s']:.0f} | |")
    print(f"| HDF5 shard write incl. fsync, MB/s | {r['c_hdf5_mb_s']:.0f} | |")
    print(f"| (c) HDF5 / dd | {r['c_hdf5_over_dd']:.3f} | >= 0.8 |")
    d_small, d_big = r["d_ours_over_ideal"], r["d_big_shard_over_ideal"]
    print(f"| (d) shard bytes / ideal ({r['tokens']} tokens) | {d_small:.4f} | <= 1.02 |")
    print(f"| (d) allocated blocks / ideal | {r['d_ours_allocated_over_ideal']:.4f} | |")
    print(f"| (d) shard bytes / ideal ({r['c_shard_tokens']} tokens) | {d_big:.4f} | <= 1.02 |")
    print(f"| peers' files bytes / ideal | {r['d_peer_over_ideal']:.3f} | |")
    print()
    print(
        "| stored dtype | compression | size / uncompressed, streamed | same, appended in order "
        "| write MB/s (streamed) | read MB/s |"
    )
    print("|---|---|---|---|---|---|")
    for c in r["compression"]:
        print(
            f"| {c['dtype']} | {c['compression']} | {c['ratio']:.3f} | {c['ratio_appended']:.3f} | "
            f"{c['write_mb_s']:.0f} | {c['read_mb_s']:.0f} |"
        )


if __name__ == "__main__":
    main()
