"""Capture through vLLM (``hidden_states.backend: vllm``) against the transformers backend.

    bash tests/vllm/setup.sh     # once: vLLM 0.32 on CPU in .venv-vllm
    .venv/bin/python benchmarks/bench_vllm_capture.py              # ~3 min on 2 cores
    .venv/bin/python benchmarks/bench_vllm_capture.py --samples 32 --rounds 5

Both backends capture the same conversations of the same model into a shard, exactly as
the hidden_states job does (the backend's extractor + ``extract_into_shard`` +
``ShardWriter``, file fsynced and renamed), interleaved round by round, the order reversed
every other round; reported: capture tokens/s of each and their ratio (median of the
per-round ratios), bytes per token of the two shards (bf16/float32 and FP8 storage), and
the per-token cosine of the two backends' states.

The vLLM server is ``tests/support/vllm_server.py``'s (the CPU connector, one bound OpenMP
thread, float32, eager); the transformers backend gets one thread too, so both compute on
one core. The model is the demo SmolLM2-135M-Instruct (``--model`` for another).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_hidden_states import demo_model_dir, workload  # noqa: E402
from support.vllm_server import HiddenStateCapture, VLLMServer, vllm_problem  # noqa: E402

from eagle3data.hidden_states.extraction import extract_into_shard  # noqa: E402
from eagle3data.hidden_states.transformers_capture import HiddenStateExtractor  # noqa: E402
from eagle3data.hidden_states.vllm_capture import VLLMCapture, vllm_layer_ids  # noqa: E402
from eagle3data.model_config import num_hidden_layers, read_model_config  # noqa: E402
from eagle3data.shards import ShardWriter, open_shard  # noqa: E402
from eagle3data.torch_utils import dtype_name  # noqa: E402

DTYPE = "float32"  # vLLM's CPU bf16 kernels need AMX where torch reports it (tests/vllm)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="local HF model dir (default: demo)")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    return p.parse_args()


def capture(
    extractor: Any, samples: list[list[int]], out: Path, batch_tokens: int, **kw: Any
) -> float:
    """Seconds to capture ``samples`` into the shard ``out``, as a job does."""
    start = time.perf_counter()
    with ShardWriter(
        out,
        hidden_size=extractor.hidden_size,
        hidden_dtype=dtype_name(extractor.dtype),
        attrs={**extractor.aux.as_attrs(), "final_state": extractor.final_state},
        **kw,
    ) as writer:
        extract_into_shard(
            extractor,
            writer,
            [f"s{i}" for i in range(len(samples))],
            samples,
            [[1] * len(s) for s in samples],
            batch_tokens=batch_tokens,
        )
    return time.perf_counter() - start


def states(path: Path) -> list[torch.Tensor]:
    with open_shard(path) as shard:
        return [
            torch.cat(
                [
                    torch.from_numpy(shard.sample(i)["aux_hidden_states"]).float(),
                    torch.from_numpy(shard.sample(i)["last_hidden_states"]).float(),
                ],
                -1,
            )
            for i in range(shard.num_samples)
        ]


def main() -> int:
    args = parse_args()
    problem = vllm_problem()
    if problem:
        print(problem)
        return 1
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = args.model or demo_model_dir(tmp)
        samples = workload(
            AutoTokenizer.from_pretrained(model), args.samples, args.min_len, args.max_len
        )
        tokens = sum(len(s) for s in samples)
        depth = num_hidden_layers(read_model_config(model))
        hf = HiddenStateExtractor(str(model), device="cpu", dtype=DTYPE)
        layers = vllm_layer_ids(hf.aux)
        capture_cfg = HiddenStateCapture(layers, tmp / "storage")
        with VLLMServer(
            model,
            capture=capture_cfg,
            reasoning_parser=None,
            tool_call_parser=None,
            max_num_seqs=16,
            extra_args=[
                "--dtype",
                DTYPE,
                "--max-num-batched-tokens",
                str(args.batch_tokens),
                "--max-model-len",
                "1024",
                "--kv-cache-memory-bytes",
                "1G",  # 30 layers: ~55 KB a token in float32
            ],
            log_path=tmp / "server.log",
        ) as server:
            vllm = VLLMCapture(str(model), dtype=DTYPE, options={"url": server.url})
            backends = {"vllm": vllm, "transformers": hf}
            capture(vllm, samples[:2], tmp / "warm.h5", args.batch_tokens)  # first request
            seconds: dict[str, list[float]] = {name: [] for name in backends}
            for r in range(args.rounds):
                order = list(backends) if r % 2 == 0 else list(reversed(backends))
                for name in order:
                    out = tmp / f"{name}.h5"
                    seconds[name].append(capture(backends[name], samples, out, args.batch_tokens))
            fp8 = {name: tmp / f"{name}-fp8.h5" for name in backends}
            for name, path in fp8.items():
                capture(
                    backends[name], samples, path, args.batch_tokens, storage_dtype="float8_e4m3fn"
                )
            vllm.close()
        ratios = [h / v for v, h in zip(seconds["vllm"], seconds["transformers"], strict=True)]
        a, b = states(tmp / "vllm.h5"), states(tmp / "transformers.h5")
        cos = torch.cat(
            [torch.nn.functional.cosine_similarity(x, y, dim=-1) for x, y in zip(a, b, strict=True)]
        )
        result = {
            "model": str(model.name),
            "layers": depth,
            "vllm_layer_ids": layers,
            "samples": len(samples),
            "tokens": tokens,
            "tokens_per_s": {
                n: round(tokens / statistics.median(s), 1) for n, s in seconds.items()
            },
            "vllm_over_transformers": round(statistics.median(ratios), 3),
            "per_round_ratios": [round(x, 3) for x in ratios],
            "bytes_per_token": {
                n: round((tmp / f"{n}.h5").stat().st_size / tokens, 1) for n in backends
            },
            "fp8_bytes_per_token": {n: round(p.stat().st_size / tokens, 1) for n, p in fp8.items()},
            "cosine_vllm_vs_transformers": {
                "min": round(cos.min().item(), 6),
                "mean": round(cos.mean().item(), 6),
            },
        }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
