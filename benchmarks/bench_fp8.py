"""FP8 hidden-state storage: bytes per token and reconstruction error per scaling granularity.

    .venv/bin/python benchmarks/bench_fp8.py --threads 1     # ~9 min on a loaded 2-core machine
    .venv/bin/python benchmarks/bench_fp8.py --model DIR --json out.json

Captures real hidden states of the demo model (SmolLM2-135M-Instruct, or ``--model``)
with the pipeline's own ``HiddenStateExtractor`` on real text: every demo prompt
rendered by the model's chat template (``demo/prompts``), and chunks of this
repository's README. The forward runs in float32 (bf16 matmuls are slow on CPUs); the
reference is those states rounded to bfloat16, the dtype of GPU runs, and every FP8
variant is quantized from that reference and dequantized back to bf16, as shards do.

Granularities (FP8 e4m3fn values, float32 scales, scale = amax / 448):

* ``tensor``: one scale per tensor (per shard); ``channel``: one per channel (per shard).
  Both need the whole shard's statistics before the first row is stored.
* ``token``: one per token row (aux: the 3H row); ``token x layer``: one per token per
  aux layer (aux: 3, last: 1); ``token x B`` (B = 256, 128, 64): one per token per
  B-channel block inside each layer (the last block of a layer is shorter when B does
  not divide H). The shards store ``token x 128`` (``FP8_BLOCK_SIZE``); the last row
  of the table is measured on shards written and read by ``eagle3data.shards``.

MB/s are bf16 megabytes handed to the writer (a GPU job's states) or returned by the
reader (per sample, as the loader reads), wall time and, in brackets, CPU time of the
process.

Reported per variant: bytes per token (3 aux + last + int32 id + uint8 mask) over bf16's,
for this model (H=576, measured on written shards where the variant ships) and for
Kimi-K2.5's H=7168 (computed); relative L2 error and cosine similarity per token (median
and worst) of the aux states (per aux layer, the worst layer) and of the last state; and
the teacher the draft trains on: lm_head(last) of the dequantized states against the
reference (top-1 agreement, KL divergence). Also the massive activations found.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from eagle3data import layout  # noqa: E402
from eagle3data.hidden_states.transformers_capture import HiddenStateExtractor  # noqa: E402
from eagle3data.shards import FP8_BLOCK_SIZE, ShardWriter, bytes_per_token, open_shard  # noqa: E402

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="local HF model dir (default: demo)")
    p.add_argument("--readme-chunks", type=int, default=8, help="README chunks of 256..512 tokens")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    return p.parse_args()


def demo_model_dir(scratch: Path) -> Path:
    demo = REPO / layout.DEMO_MODEL
    if demo.joinpath("config.json").exists():
        return demo
    from eagle3data.demo_model import convert_gguf, find_demo_gguf

    out = scratch / "SmolLM2-135M-Instruct"
    convert_gguf(find_demo_gguf(), out)
    return out


def workload(tokenizer: Any, readme_chunks: int, seed: int = 0) -> list[list[int]]:
    """Every demo prompt through the chat template, plus README chunks (real prose)."""
    samples = []
    for path in sorted((REPO / "demo" / "prompts").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            samples.append(
                tokenizer.apply_chat_template(_messages(json.loads(line)), tokenize=False)
            )
    ids = [tokenizer(s, add_special_tokens=False)["input_ids"] for s in samples]
    stream = tokenizer((REPO / "README.md").read_text(), add_special_tokens=False)["input_ids"]
    rng = np.random.default_rng(seed)
    for _ in range(readme_chunks):
        n = int(rng.integers(256, 513))
        start = int(rng.integers(0, len(stream) - n))
        ids.append(stream[start : start + n])
    return ids


def _messages(record: dict[str, Any]) -> list[dict[str, str]]:
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    if "conversations" in record:
        return [{"role": roles[m["from"]], "content": m["value"]} for m in record["conversations"]]
    if "messages" in record:
        return [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
    text = record["instruction"] + ("\n\n" + record["input"] if record.get("input") else "")
    return [{"role": "user", "content": text}]


# --------------------------------------------------------------------------- quantizers


def _safe_scale(amax: torch.Tensor) -> torch.Tensor:
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def _fp8_round_trip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return (q.float() * scale).to(torch.bfloat16).float()


def quantize(x: torch.Tensor, granularity: str, layers: int, hidden: int) -> torch.Tensor:
    """FP8 round trip of x [T, layers * hidden] (float32 holding bf16 values)."""
    t = x.shape[0]
    if granularity == "tensor":
        return _fp8_round_trip(x, _safe_scale(x.abs().amax()))
    if granularity == "channel":
        return _fp8_round_trip(x, _safe_scale(x.abs().amax(dim=0, keepdim=True)))
    if granularity == "token":
        return _fp8_round_trip(x, _safe_scale(x.abs().amax(dim=1, keepdim=True)))
    block = hidden if granularity == "token x layer" else int(granularity.split()[-1])
    per_layer = -(-hidden // block)
    padded = torch.nn.functional.pad(x.view(t, layers, hidden), (0, per_layer * block - hidden))
    blocks = padded.view(t, layers * per_layer, block)
    out = _fp8_round_trip(blocks, _safe_scale(blocks.abs().amax(dim=-1, keepdim=True)))
    return out.view(t, layers, per_layer * block)[..., :hidden].reshape(t, layers * hidden)


def scales_per_token(granularity: str, hidden: int) -> int:
    """Float32 scales stored per token (aux + last); 0 for per-shard scales."""
    if granularity in ("tensor", "channel"):
        return 0
    if granularity == "token":
        return 2
    block = hidden if granularity == "token x layer" else int(granularity.split()[-1])
    return 4 * -(-hidden // block)


def fp8_bytes_per_token(granularity: str, hidden: int) -> int:
    return 4 * hidden + 4 * scales_per_token(granularity, hidden) + 4 + 1


# --------------------------------------------------------------------------- metrics


def per_token_errors(ref: torch.Tensor, got: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Relative L2 error and cosine similarity of each row."""
    diff = torch.linalg.vector_norm(got - ref, dim=-1)
    norm = torch.linalg.vector_norm(ref, dim=-1)
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    return (diff / norm).numpy(), cos.numpy()


def teacher_agreement(
    lm_head: torch.Tensor, ref: torch.Tensor, got: torch.Tensor, chunk: int = 256
) -> dict[str, float]:
    """lm_head(last) of both: top-1 agreement and KL(ref || got) per token."""
    agree, kls = 0, []
    for start in range(0, ref.shape[0], chunk):
        a = ref[start : start + chunk] @ lm_head.T
        b = got[start : start + chunk] @ lm_head.T
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        la, lb = a.log_softmax(-1), b.log_softmax(-1)
        kls.append((la.exp() * (la - lb)).sum(-1))
    kl = torch.cat(kls).numpy()
    return {
        "top1_agree": agree / ref.shape[0],
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
    }


def massive_activations(x: torch.Tensor, layers: int, hidden: int) -> list[dict[str, Any]]:
    """Per layer: the largest |x|, the median |x|, the channels holding the top values."""
    out = []
    for k in range(layers):
        seg = x[:, k * hidden : (k + 1) * hidden].abs()
        channel_max = seg.amax(dim=0)
        top = torch.topk(channel_max, 3)
        row_ratio = seg.amax(dim=1) / seg.median(dim=1).values
        out.append(
            {
                "max_abs": float(seg.max()),
                "median_abs": float(seg.median()),
                "top_channels": top.indices.tolist(),
                "top_channel_max": [round(v, 1) for v in top.values.tolist()],
                "token_max_over_median_median": float(row_ratio.median()),
                "token_max_over_median_worst": float(row_ratio.max()),
            }
        )
    return out


def summarise(ref_aux, ref_last, aux, last, hidden: int, lm_head) -> dict[str, Any]:
    rel_a, cos_a = per_token_errors(ref_aux, aux)
    rel_l, cos_l = per_token_errors(ref_last, last)
    layer_rel, layer_cos = [], []
    for k in range(3):
        cols = slice(k * hidden, (k + 1) * hidden)
        r, c = per_token_errors(ref_aux[:, cols], aux[:, cols])
        layer_rel.append(r)
        layer_cos.append(c)
    return {
        "aux_rel_l2_median": float(np.median(rel_a)),
        "aux_rel_l2_max": float(rel_a.max()),
        "aux_cos_median": float(np.median(cos_a)),
        "aux_cos_min": float(cos_a.min()),
        "aux_layer_rel_l2_median": [float(np.median(r)) for r in layer_rel],
        "aux_layer_rel_l2_max": [float(r.max()) for r in layer_rel],
        "aux_layer_cos_min": [float(c.min()) for c in layer_cos],
        "last_rel_l2_median": float(np.median(rel_l)),
        "last_rel_l2_max": float(rel_l.max()),
        "last_cos_median": float(np.median(cos_l)),
        "last_cos_min": float(cos_l.min()),
        **teacher_agreement(lm_head, ref_last, last),
    }


# --------------------------------------------------------------------------- shipped format


def shard_round_trip(
    scratch: Path, aux: torch.Tensor, last: torch.Tensor, lengths: list[int], hidden: int
) -> dict[str, Any]:
    """Write the reference states as bf16 and as FP8 shards the way the job does
    (declared samples, rows streamed in), read every sample back as the loader does;
    best of 3, wall and CPU seconds."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    aux16, last16 = aux.to(torch.bfloat16), last.to(torch.bfloat16)  # what a GPU job hands over
    out: dict[str, Any] = {}
    for storage in ("bfloat16", "float8_e4m3fn"):
        path = scratch / f"{storage}.h5"

        def write(path: Path = path, storage: str = storage) -> None:
            with ShardWriter(
                path,
                hidden_size=hidden,
                hidden_dtype="bfloat16",
                storage_dtype=storage,  # type: ignore[arg-type]
                attrs={},
            ) as w:
                w.declare_samples(
                    [f"s{i}" for i in range(len(lengths))],
                    [np.zeros(n, np.int32) for n in lengths],
                    [np.ones(n, np.uint8) for n in lengths],
                )
                for i in range(len(lengths)):
                    rows = slice(offsets[i], offsets[i + 1])
                    w.write_states(i, aux16[rows], last16[rows])

        def read(path: Path = path) -> tuple[torch.Tensor, torch.Tensor]:
            with open_shard(path) as shard:
                parts = [
                    (
                        shard.aux_hidden_states(slice(a, b), as_torch=True),
                        shard.last_hidden_states(slice(a, b), as_torch=True),
                    )
                    for a, b in pairwise(offsets)
                ]
            return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

        write_s, write_cpu = best_of(write)
        read_s, read_cpu = best_of(read)
        out[storage] = {
            "bytes": path.stat().st_size,
            "write_s": write_s,
            "write_cpu_s": write_cpu,
            "read_s": read_s,
            "read_cpu_s": read_cpu,
        }
        if storage != "bfloat16":
            back = read()
            out["states"] = (back[0].float(), back[1].float())
    out["file_ratio"] = out["float8_e4m3fn"]["bytes"] / out["bfloat16"]["bytes"]
    return out


def best_of(fn: Any, rounds: int = 3) -> tuple[float, float]:
    """Fastest wall seconds of ``rounds`` calls, and that call's CPU seconds."""
    best = (float("inf"), float("inf"))
    for _ in range(rounds):
        start, cpu = time.perf_counter(), time.process_time()
        fn()
        best = min(best, (time.perf_counter() - start, time.process_time() - cpu))
    return best


# --------------------------------------------------------------------------- main


GRANULARITIES = [
    "tensor",
    "channel",
    "token",
    "token x layer",
    "token x 256",
    "token x 128",
    "token x 64",
]


def run(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    model_dir = args.model or demo_model_dir(scratch)
    ex = HiddenStateExtractor(str(model_dir), dtype="float32", device="cpu")
    hidden = ex.hidden_size
    samples = workload(ex.tokenizer, args.readme_chunks)
    lengths = [len(s) for s in samples]
    auxs, lasts = [], []
    for start in range(0, len(samples), 8):
        for aux, last in ex.forward(samples[start : start + 8]):
            auxs.append(aux)
            lasts.append(last)
    f32_aux, f32_last = torch.cat(auxs), torch.cat(lasts)
    ref_aux = f32_aux.to(torch.bfloat16).float()
    ref_last = f32_last.to(torch.bfloat16).float()
    lm_head = ex.model.get_output_embeddings().weight.detach().float()
    tokens = ref_aux.shape[0]
    print(
        f"model {model_dir.name} (H={hidden}, aux layers {ex.aux.layer_ids}), "
        f"{len(samples)} samples, {tokens} tokens",
        flush=True,
    )
    bf16_bytes = bytes_per_token(hidden, "bfloat16")
    rows = [
        {
            "variant": "bfloat16 (reference; its own error vs float32)",
            "bytes_ratio": 1.0,
            "bytes_ratio_kimi": 1.0,
            **summarise(f32_aux, f32_last, ref_aux, ref_last, hidden, lm_head),
        }
    ]
    for g in GRANULARITIES:
        aux_q = quantize(ref_aux, g, 3, hidden)
        last_q = quantize(ref_last, g, 1, hidden)
        rows.append(
            {
                "variant": f"fp8, {g}",
                "bytes_ratio": fp8_bytes_per_token(g, hidden) / bf16_bytes,
                "bytes_ratio_kimi": fp8_bytes_per_token(g, 7168)
                / bytes_per_token(7168, "bfloat16"),
                **summarise(ref_aux, ref_last, aux_q, last_q, hidden, lm_head),
            }
        )
        print(f"{g}: done", flush=True)
    shipped = shard_round_trip(scratch, ref_aux, ref_last, lengths, hidden)
    aux_s, last_s = shipped["states"]
    rows.append(
        {
            "variant": f"shipped: ShardWriter float8_e4m3fn (block {FP8_BLOCK_SIZE}), file bytes",
            "bytes_ratio": shipped["file_ratio"],
            "bytes_ratio_kimi": bytes_per_token(7168, "bfloat16", "float8_e4m3fn")
            / bytes_per_token(7168, "bfloat16"),
            **summarise(ref_aux, ref_last, aux_s, last_s, hidden, lm_head),
        }
    )
    bf16_mb = tokens * 4 * hidden * 2 / 1e6  # states handed to / returned by the shard module
    timing = {
        storage: {
            "write_mb_s": bf16_mb / shipped[storage]["write_s"],
            "write_cpu_mb_s": bf16_mb / shipped[storage]["write_cpu_s"],
            "read_mb_s": bf16_mb / shipped[storage]["read_s"],
            "read_cpu_mb_s": bf16_mb / shipped[storage]["read_cpu_s"],
            "file_bytes": shipped[storage]["bytes"],
        }
        for storage in ("bfloat16", "float8_e4m3fn")
    }
    report = {
        "model": model_dir.name,
        "hidden_size": hidden,
        "aux_layer_ids": list(ex.aux.layer_ids),
        "samples": len(samples),
        "tokens": tokens,
        "massive_activations": {
            "aux": massive_activations(ref_aux, 3, hidden),
            "last": massive_activations(ref_last, 1, hidden),
        },
        "rows": rows,
        "timing": timing,
        "torch_threads": torch.get_num_threads(),
    }
    print_report(report)
    return report


def print_report(r: dict[str, Any]) -> None:
    print()
    print("| layer | max abs | median abs | top channels (max abs) | token max/median |")
    print("|---|---|---|---|---|")
    names = [f"aux {k}" for k in r["aux_layer_ids"]] + ["last (post-norm)"]
    stats = r["massive_activations"]["aux"] + r["massive_activations"]["last"]
    for name, s in zip(names, stats, strict=True):
        pairs = zip(s["top_channels"], s["top_channel_max"], strict=True)
        top = ", ".join(f"{c} ({v:g})" for c, v in pairs)
        print(
            f"| {name} | {s['max_abs']:.1f} | {s['median_abs']:.3f} | {top} | "
            f"median {s['token_max_over_median_median']:.0f}, "
            f"worst {s['token_max_over_median_worst']:.0f} |"
        )
    print()
    print(
        "| variant | bytes/token vs bf16 (H=576) | (H=7168) | aux rel L2 median / worst "
        "| aux worst layer: rel L2 worst | aux cos median / worst | last rel L2 median / worst "
        "| last cos median / worst | teacher top-1 agree | teacher KL mean / max |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in r["rows"]:
        worst_layer = max(row["aux_layer_rel_l2_max"])
        print(
            f"| {row['variant']} | {row['bytes_ratio']:.4f} | {row['bytes_ratio_kimi']:.4f} | "
            f"{row['aux_rel_l2_median']:.4f} / {row['aux_rel_l2_max']:.4f} | {worst_layer:.4f} | "
            f"{row['aux_cos_median']:.6f} / {row['aux_cos_min']:.6f} | "
            f"{row['last_rel_l2_median']:.4f} / {row['last_rel_l2_max']:.4f} | "
            f"{row['last_cos_median']:.6f} / {row['last_cos_min']:.6f} | "
            f"{row['top1_agree']:.4f} | {row['kl_mean']:.2e} / {row['kl_max']:.2e} |"
        )
    print()
    print(
        f"| shard module, {r['tokens']} tokens, torch threads {r['torch_threads']} "
        "| file bytes | write MB/s (CPU) | read MB/s (CPU) |"
    )
    print("|---|---|---|---|")
    for storage, t in r["timing"].items():
        print(
            f"| {storage} | {t['file_bytes']} | {t['write_mb_s']:.0f} ({t['write_cpu_mb_s']:.0f}) "
            f"| {t['read_mb_s']:.0f} ({t['read_cpu_mb_s']:.0f}) |"
        )


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    scratch = Path(tempfile.mkdtemp(prefix=".bench-fp8-"))
    try:
        report = run(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
