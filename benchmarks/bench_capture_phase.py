"""One load of the target per capture phase: loads and wall time of the capture, per run.

    .venv/bin/python benchmarks/bench_capture_phase.py                        # transformers, ~6 min
    .venv-sglang/bin/python benchmarks/bench_capture_phase.py --backend sglang  # real SGLang CPU
    bash tests/vllm/setup.sh && .venv/bin/python benchmarks/bench_capture_phase.py --backend vllm

One workflow (``tests/support/workflow.py``: the README's Snakemake command in a temporary
copy) generates and tokenizes ``--prompts`` conversations once; then the capture alone
(``snakemake`` with the shard files as targets, the shards deleted before each run) is timed
three ways, round by round in one process, the order rotated every round:

* ``per-shard``: ``engine_lifetime: shard`` (every shard job loads the target: before);
* ``per-phase``: the default, the same shards (now);
* ``one shard``: the default, ``shard_bytes`` large enough for one shard of the same tokens.

With ``--backend vllm`` the target is loaded once by the capture server the user runs
(``tests/support/vllm_server.py``'s, float32 on the CPU, started once here); what is counted
as a load there is a start of the server's client (torch's import, the server's checks, the
probe request): per shard job with ``engine_lifetime: shard``, per run with the default.

Loads are counted from outside the code that avoids them: the transformers backend's
``HiddenStateExtractor`` builds (``tests/support/instrument``), SGLang's engine starts (the
"started capture engine" lines, or one per shard job when each loads its own). Reported:
median wall seconds per way, loads per run, and the ratios per-phase / one shard (the goal:
at most 1.1) and per-shard / per-phase.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_hidden_states import demo_model_dir  # noqa: E402
from support.workflow import Workflow, new_workflow, sharegpt_prompts, write_prompts  # noqa: E402

INSTRUMENT = REPO / "tests" / "support" / "instrument"
RESULTS = "results/hidden_states/A1"
MANIFEST = f"{RESULTS}/manifest.json"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", choices=["transformers", "sglang", "vllm"], default="transformers")
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=96, help="generated tokens per response")
    p.add_argument("--shards", type=int, default=8, help="about this many shards per-shard")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--model",
        choices=["demo", "tiny"],
        default=None,
        help="the target: SmolLM2 (demo; the default for transformers) or the engine suites' "
        "tiny Llama (the default for sglang and vllm, whose shards then take a tenth of a "
        "second each: a run measures the jobs' own cost more than the capture's)",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    return p.parse_args()


def tiny_llama(scratch: Path, head_dim: int | None = None) -> Path:
    from support.target_models import make_llama_dir

    return make_llama_dir(scratch / "tiny-llama", head_dim=head_dim)


def capture_settings(backend: str, url: str | None = None) -> dict[str, Any]:
    if backend == "transformers":
        return {"backend": "transformers", "dtype": "float32", "batch_tokens": 2048}
    if backend == "vllm":
        # Batches the size tests/vllm sends: the CPU server has a small KV cache.
        return {"backend": "vllm", "dtype": "float32", "batch_tokens": 256, "vllm": {"url": url}}
    from support.sglang_cpu import CPU_ENGINE_ARGS

    return {
        "backend": "sglang",
        "device": "cpu",
        "dtype": "bfloat16",
        "batch_tokens": 2048,
        "sglang": {
            "tp_size": 1,
            "mem_fraction_static": 0.5,
            "extra_args": {k: v for k, v in CPU_ENGINE_ARGS.items() if k != "device"},
        },
    }


def shard_bytes_for(wf: Workflow, shards: int) -> int:
    """A shard size that splits the dataset into about ``shards`` shards."""
    plan = json.loads(wf.path(f"{RESULTS}/plan.json").read_text())
    return max(1, plan["estimated_bytes"] // shards)


def loads(wf: Workflow, backend: str) -> int:
    if backend == "transformers":
        path = wf.path("loads.jsonl")
        return len(path.read_text().splitlines()) if path.exists() else 0
    # An engine per "started capture engine" line, or per shard job loading its own (for
    # vllm: its own client of the server, which loaded the target once before any run).
    shard_logs = list(wf.path("logs/hidden_states/A1").glob("*.log"))
    logs = "".join(p.read_text() for p in shard_logs)
    started = logs.count("started capture engine")
    if backend == "vllm":
        return started or len(shard_logs)
    return started or logs.count("starting sglang capture engine")


def capture_run(
    wf: Workflow, backend: str, lifetime: str, shard_bytes: int
) -> tuple[float, int, int]:
    """Wall seconds, loads and shards of one capture of the dataset."""
    wf.config["hidden_states"].update(engine_lifetime=lifetime, shard_bytes=shard_bytes)
    wf.write_config()
    for path in [*wf.path(RESULTS).glob("shard-*.h5"), *wf.path("logs/hidden_states/A1").glob("*")]:
        path.unlink()
    wf.path("loads.jsonl").unlink(missing_ok=True)
    wf.run(f"{RESULTS}/plan.json")  # a new shard size plans anew: not part of the capture
    plan = json.loads(wf.path(f"{RESULTS}/plan.json").read_text())
    targets = [f"{RESULTS}/shard-{s['shard']:05d}.h5" for s in plan["shards"]]
    start = time.perf_counter()
    wf.run(*targets, timeout=3600)
    wall = time.perf_counter() - start
    return wall, loads(wf, backend), len(list(wf.path(RESULTS).glob("shard-*.h5")))


def vllm_capture_server(model: Path, scratch: Path) -> Any:
    from support.vllm_server import HiddenStateCapture, VLLMServer

    from eagle3data.hidden_states.layers import resolve_aux_layers
    from eagle3data.hidden_states.vllm_capture import vllm_layer_ids

    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    aux = resolve_aux_layers("auto", layers, "layer_output")
    return VLLMServer(
        model,
        capture=HiddenStateCapture(vllm_layer_ids(aux), scratch / "vllm-storage"),
        reasoning_parser=None,
        tool_call_parser=None,
        max_num_seqs=8,
        extra_args=["--dtype", "float32", "--max-model-len", "1024"],
        log_path=scratch / "vllm-server.log",
    )


def main() -> int:
    args = parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-capture-phase-"))
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, scratch, ignore_errors=True)
        # The demo model in-process; the tiny Llama of the engine suites for the engines.
        vllm = args.backend == "vllm"
        demo = (args.model or ("demo" if args.backend == "transformers" else "tiny")) == "demo"
        # vLLM's CPU attention wants heads of 32 or more (tests/support/vllm_server.py).
        model = demo_model_dir(scratch) if demo else tiny_llama(scratch, 32 if vllm else None)
        url = None
        if args.backend == "vllm":
            server = stack.enter_context(vllm_capture_server(model, scratch))
            url = server.url
        try:
            run(args, scratch, model, url)
        except Exception:
            if args.backend == "vllm":  # the server's side of a failed capture
                lines = (scratch / "vllm-server.log").read_text().splitlines()
                first = next((i for i, line in enumerate(lines) if "Traceback" in line), 0)
                print("\n".join(lines[first : first + 80]), file=sys.stderr)
            raise
    return 0


def run(args: argparse.Namespace, scratch: Path, model: Path, url: str | None) -> None:
    """Generate and tokenize once, then time the capture every way, round by round."""
    prompts = write_prompts(scratch / "prompts.jsonl", sharegpt_prompts(args.prompts))
    wf = new_workflow(
        scratch,
        model,
        {"A1": {"path": str(prompts), "format": "sharegpt"}},
        generation={"sampling": {"temperature": 0.0, "max_tokens": args.max_tokens}},
        hidden_states={**capture_settings(args.backend, url), "shard_bytes": 2**40},
    )
    wf.env.update(
        PYTHONPATH=os.pathsep.join([str(INSTRUMENT), os.environ.get("PYTHONPATH", "")]),
        EAGLE3DATA_LOAD_LOG=str(wf.path("loads.jsonl")),
    )
    if args.backend == "sglang":
        from support.sglang_cpu import sglang_env

        wf.env.update(sglang_env({}, ranks=1))
    wf.run(f"{RESULTS}/plan.json", timeout=3600)  # prompts, generation, tokenize: once
    small = shard_bytes_for(wf, args.shards)
    ways = {
        "per-shard": ("shard", small),
        "per-phase": ("phase", small),
        "one shard": ("phase", 2**40),
    }
    results: dict[str, list[tuple[float, int, int]]] = {name: [] for name in ways}
    names = list(ways)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            lifetime, shard_bytes = ways[name]
            results[name].append(capture_run(wf, args.backend, lifetime, shard_bytes))
            wall, n_loads, n_shards = results[name][-1]
            print(f"round {r + 1} {name}: {wall:.1f} s, {n_loads} load(s), {n_shards} shard(s)")
    median = {name: statistics.median(w for w, _, _ in runs) for name, runs in results.items()}
    summary = {
        "backend": args.backend,
        "rounds": args.rounds,
        "ways": {
            name: {
                "median_wall_s": round(median[name], 2),
                "loads": results[name][-1][1],
                "shards": results[name][-1][2],
            }
            for name in names
        },
        "per_phase_over_one_shard": round(median["per-phase"] / median["one shard"], 3),
    }
    if "per-shard" in median:
        summary["per_shard_over_per_phase"] = round(median["per-shard"] / median["per-phase"], 3)
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    raise SystemExit(main())
