"""Offline model directories shaped like the real targets: Kimi-K2.5 and Qwen3 (thinking).

No hub: everything is built here, small and deterministic, in the exact *shape* that matters
to the workflow.

Kimi-K2.5 (``make_kimi_dir``) is the awkward target, and the fixture keeps every awkward part:

* the tokenizer loads only through remote code (``tokenization_kimi.py`` + ``tiktoken.model``,
  no ``tokenizer.json``), is slow (``is_fast`` False) and uses Kimi's own split pattern;
  loading the directory *without* ``trust_remote_code`` lets transformers convert
  ``tiktoken.model`` into a fast tokenizer with a generic GPT-4 split, which loads fine and
  writes different ids (the bug the main code must refuse);
* the ids are Kimi's: a base vocabulary of exactly 163,584 ranks, the named special tokens at
  Kimi-K2's ids after it, 163,840 ids in all;
* the chat template is the real K2.5 one (thinking on by default, reasoning dropped from
  history turns);
* the model is a DeepSeek-V3 decoder, optionally wrapped the way K2.5 ships it
  (``KimiK25ForConditionalGeneration``: sizes only in ``text_config``, weights under
  ``language_model.*`` next to vision tensors).

tiktoken caches the vocabulary files it reads (see ``tiktoken_cache``): tests that build a
Kimi directory should point ``TIKTOKEN_CACHE_DIR`` at an empty temporary directory or at "".

Qwen3 (``make_qwen3_dir``) is the ordinary fast-tokenizer thinking target, for contrast.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import itertools
import json
import os
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        LlamaForCausalLM,
        PreTrainedTokenizerBase,
    )

KIMI_THINK_OPEN = "<think>"
KIMI_THINK_CLOSE = "</think>"
KIMI_END_OF_TURN = "<|im_end|>"

# Kimi-K2's tiktoken.model has 163,584 ranks; tokenization_kimi.py reserves 256 special ids
# right after them (163,584 .. 163,839), so the model's vocab_size is 163,840.
KIMI_NUM_BASE_TOKENS = 163_584
KIMI_NUM_RESERVED_SPECIAL = 256
KIMI_VOCAB_SIZE = KIMI_NUM_BASE_TOKENS + KIMI_NUM_RESERVED_SPECIAL

# The named special tokens and their ids, from Kimi-K2's (and K2.5's) tokenizer_config.json
# `added_tokens_decoder`. The other reserved ids are `<|reserved_token_{id}|>`.
KIMI_SPECIAL_IDS: dict[str, int] = {
    "[BOS]": 163584,
    "[EOS]": 163585,
    "<|im_end|>": 163586,
    "<|im_user|>": 163587,
    "<|im_assistant|>": 163588,
    "<|start_header_id|>": 163590,
    "<|end_header_id|>": 163591,
    "[EOT]": 163593,
    "<|im_system|>": 163594,
    "<|tool_calls_section_begin|>": 163595,
    "<|tool_calls_section_end|>": 163596,
    "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598,
    "<|tool_call_end|>": 163599,
    "<|im_middle|>": 163601,
    "<think>": 163606,
    "</think>": 163607,
    "[UNK]": 163838,
    "[PAD]": 163839,
}
KIMI_BOS_ID = KIMI_SPECIAL_IDS["[BOS]"]
KIMI_PAD_ID = KIMI_SPECIAL_IDS["[PAD]"]
# Kimi's generation_config.json stops on <|im_end|>, not on the tokenizer's [EOS].
KIMI_GENERATION_EOS_ID = KIMI_SPECIAL_IDS[KIMI_END_OF_TURN]

# Kimi's pre-tokenizer split (TikTokenTokenizer.pat_str in Moonshot's tokenization_kimi.py):
# Han runs apart, letter runs with an optional English contraction glued on (" don't" is one
# piece, unlike the GPT-4 split transformers' converter uses), then GPT-4's number,
# punctuation and whitespace rules.
KIMI_PAT_STR = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

# moonshotai/Kimi-K2.5 chat_template.jinja, verbatim, as copied into
# lightseekorg/smg @ a18d64f, crates/tokenizer/tests/fixtures/kimi_k25/chat_template.jinja.
KIMI_K25_CHAT_TEMPLATE = r"""{%- macro render_content(msg) -%}
    {%- set c = msg.get('content') -%}
    {%- if c is string -%}
      {{ c }}
    {%- elif c is not none -%}
      {% for content in c -%}
        {% if content['type'] == 'image' or content['type'] == 'image_url' -%}
          <|media_begin|>image<|media_content|><|media_pad|><|media_end|>
        {% elif content['type'] == 'video' or content['type']== 'video_url'-%}
          <|kimi_k25_video_placeholder|>
        {% else -%}
          {{ content['text'] }}
        {%- endif -%}
      {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}

{% macro set_roles(message) -%}
  {%- set role_name =  message.get('name') or  message['role'] -%}
  {%- if message['role'] == 'user' -%}
    <|im_user|>{{role_name}}<|im_middle|>
  {%- elif message['role'] == 'assistant' -%}
    <|im_assistant|>{{role_name}}<|im_middle|>
  {%- else -%}
    <|im_system|>{{role_name}}<|im_middle|>
  {%- endif -%}
{%- endmacro -%}


{%- macro render_toolcalls(message) -%}
  <|tool_calls_section_begin|>
  {%- for tool_call in message['tool_calls'] -%}
    {%- set formatted_id = tool_call['id'] -%}
    <|tool_call_begin|>{{ formatted_id }}<|tool_call_argument_begin|>{% if tool_call['function']['arguments'] is string %}{{ tool_call['function']['arguments'] }}{% else %}{{ tool_call['function']['arguments'] | tojson }}{% endif %}<|tool_call_end|>
  {%- endfor -%}
  <|tool_calls_section_end|>
{%- endmacro -%}


{# Find last non-tool-call assistant message #}
{%- set ns = namespace(last_non_tool_call_assistant_msg=-1) -%}
{%- for idx in range(messages|length-1, -1, -1) -%}
    {%- if messages[idx]['role'] == 'assistant' and not messages[idx].get('tool_calls') -%}
        {%- set ns.last_non_tool_call_assistant_msg = idx -%}
        {%- break -%}
    {%- endif -%}
{%- endfor -%}

{# split all messages into history & suffix, reasoning_content in suffix should be reserved.#}
{%- set hist_msgs = messages[:ns.last_non_tool_call_assistant_msg+1] -%}
{%- set suffix_msgs = messages[ns.last_non_tool_call_assistant_msg+1:] -%}

{%- if tools -%}
  {%- if tools_ts_str -%}
    <|im_system|>tool_declare<|im_middle|>{{ tools_ts_str }}<|im_end|>
  {%- else -%}
    <|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
  {%- endif -%}
{%- endif -%}

{%- for message in hist_msgs -%}
  {{set_roles(message)}}
  {%- if message['role'] == 'assistant' -%}
    <think></think>{{render_content(message)}}
    {%- if message.get('tool_calls') -%}
      {{render_toolcalls(message)}}
    {%- endif -%}
  {%- elif message['role'] == 'tool' -%}
    {%- set tool_call_id = message.tool_call_id -%}
    ## Return of {{ tool_call_id }}
{{render_content(message)}}
  {%- elif message['content'] is not none -%}
    {{render_content(message)}}
  {%- endif -%}
  <|im_end|>
{%- endfor -%}

{%- for message in suffix_msgs -%}
  {{set_roles(message)}}
  {%- if message['role'] == 'assistant' -%}
    {%- if thinking is defined and thinking is false -%}
    <think></think>{{render_content(message)}}
    {%- else -%}
    {%- set rc = message.get('reasoning_content', '') -%}
    <think>{{rc}}</think>{{render_content(message)}}
    {%- endif -%}
    {%- if message.get('tool_calls') -%}
     {{render_toolcalls(message)}}
    {%- endif -%}
  {%- elif message['role'] == 'tool' -%}
    {%- set tool_call_id = message.tool_call_id -%}
    ## Return of {{ tool_call_id }}
{{render_content(message)}}
  {%- elif message['content'] is not none -%}
    {{render_content(message)}}
  {%- endif -%}
  <|im_end|>
{%- endfor -%}


{%- if add_generation_prompt -%}
  <|im_assistant|>assistant<|im_middle|>
  {%- if thinking is defined and thinking is false -%}
  <think></think>
  {%- else -%}
  <think>
  {%- endif -%}
{%- endif -%}
"""  # noqa: E501

# Our own tokenizer module, written next to tiktoken.model the way Kimi repos ship theirs.
# Behaviour follows Moonshot's TikTokenTokenizer (same ids, same encode/decode contract);
# the code is not theirs. It must import on its own: transformers loads it as remote code.
TOKENIZATION_KIMI_PY = r'''"""A Kimi-compatible slow tiktoken tokenizer (a test fixture)."""

from __future__ import annotations

import os
import shutil
from typing import Any, ClassVar

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import AddedToken, PreTrainedTokenizer

NUM_RESERVED_SPECIAL_TOKENS = 256
PAT_STR = @@PAT_STR@@  # noqa: E501


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (gone from transformers 5.23's gpt2 module)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    table = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shift)
            shift += 1
    return table


BYTE_TO_UNICODE = _byte_to_unicode()
UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}


def _token_string(token: bytes) -> str:
    return token.decode("latin-1").translate(BYTE_TO_UNICODE)


class TikTokenTokenizer(PreTrainedTokenizer):
    """Kimi's tokenizer contract: tiktoken ranks, then 256 special ids after them."""

    vocab_files_names: ClassVar[dict[str, str]] = {"vocab_file": "tiktoken.model"}
    model_input_names: ClassVar[list[str]] = ["input_ids", "attention_mask"]

    def __init__(
        self,
        vocab_file: str,
        bos_token: str | AddedToken = "[BOS]",
        eos_token: str | AddedToken = "[EOS]",
        unk_token: str | AddedToken | None = None,
        pad_token: str | AddedToken | None = None,
        added_tokens_decoder: dict[int, AddedToken] | None = None,
        **kwargs: Any,
    ) -> None:
        added_tokens_decoder = dict(added_tokens_decoder or {})
        names = {int(i): str(token) for i, token in added_tokens_decoder.items()}
        ranks = load_tiktoken_bpe(vocab_file)
        num_base = len(ranks)
        self.vocab_file = vocab_file
        self.mergeable_ranks = ranks
        self.special_tokens = {
            names.get(i, f"<|reserved_token_{i}|>"): i
            for i in range(num_base, num_base + NUM_RESERVED_SPECIAL_TOKENS)
        }
        self.model = tiktoken.Encoding(
            name=os.path.basename(vocab_file),
            pat_str=PAT_STR,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        self._special_names = {i: name for name, i in self.special_tokens.items()}
        self._vocab: dict[str, int] | None = None
        # Every special id is an added token, reserved ones included: the python backend's
        # tokenize() then cuts text at exactly the strings that encode() (allowed_special=
        # "all") reads as special, so both routes give the same ids.
        self._added_tokens_decoder = {
            i: AddedToken(name, lstrip=False, rstrip=False, normalized=False, special=True)
            for name, i in self.special_tokens.items()
        }
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(
            bos_token=bos_token,
            eos_token=eos_token,
            unk_token=unk_token,
            pad_token=pad_token,
            added_tokens_decoder=added_tokens_decoder,
            **kwargs,
        )

    @property
    def vocab_size(self) -> int:
        return self.model.n_vocab

    def get_vocab(self) -> dict[str, int]:
        if self._vocab is None:
            vocab = {_token_string(t): rank for t, rank in self.mergeable_ranks.items()}
            vocab.update(self.special_tokens)
            self._vocab = vocab
        return dict(self._vocab)

    def encode(self, text: str, **kwargs: Any) -> list[int]:  # type: ignore[override]
        """Plain ``encode(text)`` is tiktoken with every special token allowed, as in Kimi's."""
        if kwargs:
            return super().encode(text, **kwargs)
        return self.model.encode(text, allowed_special="all")

    def decode(self, token_ids: Any, **kwargs: Any) -> str:  # type: ignore[override]
        if kwargs:
            return super().decode(token_ids, **kwargs)
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return self.model.decode([int(t) for t in token_ids])

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        return [self._convert_id_to_token(i) for i in self.encode(text)]

    def _convert_token_to_id(self, token: str) -> int:
        if token in self.special_tokens:
            return self.special_tokens[token]
        try:
            rank = self.mergeable_ranks.get(bytes(UNICODE_TO_BYTE[c] for c in token))
        except KeyError:
            rank = None
        return rank if rank is not None else self.special_tokens[str(self.unk_token)]

    def _convert_id_to_token(self, index: int) -> str:
        if index in self._special_names:
            return self._special_names[index]
        return _token_string(self.model.decode_single_token_bytes(index))

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        data = bytearray()
        for char in "".join(tokens):
            byte = UNICODE_TO_BYTE.get(char)
            data.extend(char.encode("utf-8") if byte is None else bytes([byte]))
        return data.decode("utf-8", "replace")

    @staticmethod
    def clean_up_tokenization(out_string: str) -> str:
        return out_string

    def save_vocabulary(
        self, save_directory: str, filename_prefix: str | None = None
    ) -> tuple[str, ...]:
        name = (filename_prefix + "-" if filename_prefix else "") + "tiktoken.model"
        target = os.path.join(save_directory, name)
        if os.path.abspath(self.vocab_file) != os.path.abspath(target):
            shutil.copyfile(self.vocab_file, target)
        return (target,)
'''

# A small English corpus for the synthetic merges. Contractions are frequent on purpose:
# Kimi's split keeps " don't" whole, GPT-4's cuts it at the apostrophe, and with merges
# learned across the apostrophe the two tokenizers disagree on the ids.
_KIMI_CORPUS = [
    "You are a helpful assistant. The user asks and the assistant answers.",
    "What is the capital of France? The capital of France is Paris.",
    "And of Germany? Berlin is the capital of Germany, and it's a large city.",
    "Let me think about the question. The user asks about a capital city.",
    "I don't know the answer yet, so I'll think step by step before I answer.",
    "It's simple: don't guess, check the facts first. That's what we've learned.",
    "You're right, they'll say it isn't hard, but I'd rather be careful than wrong.",
    "We don't skip steps. It's the reasoning that matters, and it's worth the time.",
    "Paris, Berlin, Rome and Madrid are capitals. Numbers like 12, 345 and 2024 appear too.",
    "system user assistant think answer question reasoning content message",
    "The weather is nice today. Can't we go outside? Won't you come with me?",
    "Hello, world! Here is some code: def add(a, b): return a + b",
]
_KIMI_CORPUS_REPEATS = 3
_KIMI_MAX_MERGES = 800

# K2.5's YaRN, as its config.json (text_config.rope_parameters) has it.
K25_ROPE_PARAMETERS: dict[str, Any] = {
    "rope_type": "yarn",
    "rope_theta": 50000.0,
    "factor": 64.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

_KIMI_MODEL_SIZES: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "max_position_embeddings": 262144,  # K2.5's, which its YaRN factor implies
    # SGLang's CPU RoPE for DeepSeek models takes only (deepseek_)yarn, which K2.x ships.
    "rope_parameters": K25_ROPE_PARAMETERS,
    "num_nextn_predict_layers": 0,
    # As in K2.5's config.json (DeepSeek-V3's router keys): transformers' DeepseekV3Config
    # neither needs nor writes them, SGLang's deepseek_v2 reads them.
    "moe_layer_freq": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
}


@contextlib.contextmanager
def tiktoken_cache(cache_dir: str | os.PathLike[str] = "") -> Iterator[None]:
    """Point ``TIKTOKEN_CACHE_DIR`` at ``cache_dir`` for the block ("" turns caching off).

    tiktoken 0.14's ``load_tiktoken_bpe`` reads every file through ``read_file_cached``, local
    paths included: the cache key is the SHA-1 of the *path string*, and with no expected hash
    a cached copy is returned without looking at the file again. The cache lives in
    ``$TIKTOKEN_CACHE_DIR`` (else ``$DATA_GYM_CACHE_DIR``, else ``<tmp>/data-gym-cache``), so a
    ``tiktoken.model`` rebuilt at a path that was loaded before (pytest reuses ``tmp_path``
    names across runs) can load the old ranks. An empty ``TIKTOKEN_CACHE_DIR`` disables the
    cache; an empty temporary directory isolates it. Pytest-free on purpose: subprocess-based
    tests can copy ``os.environ`` inside the block.
    """
    old = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = os.fspath(cache_dir)
    try:
        yield
    finally:
        if old is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = old


def _pretokenize(texts: list[str]) -> Counter[bytes]:
    """Word counts under Kimi's split (the ``regex`` module needs V1 for ``&&`` classes)."""
    import regex

    pattern = regex.compile(KIMI_PAT_STR, regex.V1)
    return Counter(piece.encode() for text in texts for piece in pattern.findall(text))


def _learn_merges(words: Counter[bytes], max_merges: int) -> list[bytes]:
    """Plain BPE: merge the most frequent adjacent pair (ties: the larger pair) until none
    occurs twice. Deterministic, and each new token's parts are older tokens, so tiktoken's
    lowest-rank-first merging can build every learned token."""
    splits = {word: [bytes([b]) for b in word] for word in words}
    known: set[bytes] = {bytes([b]) for b in range(256)}
    merged: list[bytes] = []
    while len(merged) < max_merges:
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for word, parts in splits.items():
            for pair in itertools.pairwise(parts):
                pairs[pair] += words[word]
        if not pairs:
            break
        (left, right), count = max(pairs.items(), key=lambda item: (item[1], item[0]))
        if count < 2:
            break
        token = left + right
        for word, parts in splits.items():
            if len(parts) < 2:
                continue
            out: list[bytes] = []
            i = 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == left and parts[i + 1] == right:
                    out.append(token)
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            splits[word] = out
        if token not in known:
            known.add(token)
            merged.append(token)
    return merged


def kimi_ranks() -> list[bytes]:
    """The synthetic ``tiktoken.model`` ranks, in order: 256 bytes, merges, filler.

    Filler tokens start with byte 0xFF, which never occurs in UTF-8, so ``encode`` never
    produces them; they only pad the base vocabulary to Kimi's 163,584 ranks so that the
    special tokens get Kimi's real ids.
    """
    tokens = [bytes([b]) for b in range(256)]
    tokens += _learn_merges(_pretokenize(_KIMI_CORPUS * _KIMI_CORPUS_REPEATS), _KIMI_MAX_MERGES)
    tokens += [
        b"\xff" + rank.to_bytes(3, "big") for rank in range(len(tokens), KIMI_NUM_BASE_TOKENS)
    ]
    return tokens


def _write_tiktoken_model(path: Path) -> None:
    lines = [base64.b64encode(t) + b" " + str(rank).encode() for rank, t in enumerate(kimi_ranks())]
    path.write_bytes(b"\n".join(lines) + b"\n")


def _added_token(content: str) -> dict[str, Any]:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }


def _write_kimi_tokenizer(out: Path) -> None:
    """tiktoken.model + tokenization_kimi.py + configs + chat_template.jinja; no tokenizer.json."""
    _write_tiktoken_model(out / "tiktoken.model")
    source = TOKENIZATION_KIMI_PY.replace("@@PAT_STR@@", repr(KIMI_PAT_STR))
    (out / "tokenization_kimi.py").write_text(source)
    roles = {"bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]"}
    extra = [name for name in KIMI_SPECIAL_IDS if name not in roles.values()]
    config = {
        "added_tokens_decoder": {str(i): _added_token(t) for t, i in KIMI_SPECIAL_IDS.items()},
        "additional_special_tokens": extra,
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        **roles,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
        "tokenizer_class": "TikTokenTokenizer",
    }
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", {**roles, "additional_special_tokens": extra})
    (out / "chat_template.jinja").write_text(KIMI_K25_CHAT_TEMPLATE)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


_KIMI_HEAD_SCALE = 50.0


@functools.cache
def _kimi_word_ids() -> list[int]:
    """Ids of the fixture's whole-word tokens: a space and 3+ ASCII letters."""
    return [
        rank
        for rank, token in enumerate(kimi_ranks())
        if token.startswith(b" ") and token[1:].isalpha() and len(token) >= 4
    ]


# Kimi-K2.5's own MLA head dimensions, at a small width: vLLM's CPU MLA attention runs only
# K2.5's latent size (kv_lora_rank 512 + qk_rope_head_dim 64; the toy sizes' 16 + 8 fail at
# the first request, "Head dimension 24 is not supported by MLA").
K25_MLA_SIZES: dict[str, Any] = {
    "hidden_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}


def kimi_text_config(**sizes: Any) -> DeepseekV3Config:
    """The tiny DeepSeek-V3 decoder config: Kimi's vocab and special ids, toy sizes
    (``sizes`` replace some)."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=KIMI_VOCAB_SIZE,
        bos_token_id=KIMI_BOS_ID,
        eos_token_id=KIMI_GENERATION_EOS_ID,
        pad_token_id=KIMI_PAD_ID,
        tie_word_embeddings=False,
        dtype="bfloat16",
        **{**_KIMI_MODEL_SIZES, **sizes},
    )


def _kimi_random_decoder(**sizes: Any) -> DeepseekV3ForCausalLM:
    """Seeded, so the plain and the wrapped directory hold the same weights."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(kimi_text_config(**sizes))
    with torch.no_grad():
        # Like a trained head, and unlike a random init, this one makes the data check
        # itself (the validate job's agreement check): a random head's logits are
        # near-uniform, so greedy picks are near-ties that bf16 vs float32 flip, and its
        # token soup does not survive decode -> re-render -> encode. Scaled up, and only
        # whole-word tokens (" capital") can win, which re-encode to themselves.
        words = torch.zeros(KIMI_VOCAB_SIZE)
        words[_kimi_word_ids()] = _KIMI_HEAD_SCALE
        model.lm_head.weight.mul_(words[:, None])
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config.bos_token_id = KIMI_BOS_ID
    model.generation_config.eos_token_id = KIMI_GENERATION_EOS_ID
    model.generation_config.pad_token_id = KIMI_PAD_ID
    return model.eval()


def _kimi_vision_tensors(text_hidden: int) -> dict[str, torch.Tensor]:
    """A few MoonViT / projector tensors, so the wrapper checkpoint is not text-only."""
    import torch

    generator = torch.Generator().manual_seed(1)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    return {
        "vision_tower.patch_embed.proj.weight": rand(16, 3, 14, 14),
        "vision_tower.patch_embed.proj.bias": rand(16),
        "vision_tower.encoder.final_layernorm.weight": rand(16),
        "mm_projector.pre_norm.weight": rand(16),
        "mm_projector.proj.0.weight": rand(64, 64),
        "mm_projector.proj.2.weight": rand(text_hidden, 64),
    }


def _kimi_wrapper_config(**sizes: Any) -> dict[str, Any]:
    """K2.5's config.json shape: no top-level sizes, the decoder (``sizes`` over the toy
    ones) under ``text_config``."""
    from transformers import Kimi_K25Config, Kimi_K25VisionConfig

    vision = Kimi_K25VisionConfig(
        patch_size=14,
        num_hidden_layers=1,
        num_attention_heads=2,
        hidden_size=16,
        intermediate_size=32,
        pos_emb_height=8,
        pos_emb_width=8,
    )
    config = Kimi_K25Config(
        text_config=kimi_text_config(**sizes).to_dict(),
        vision_config=vision.to_dict(),
        projection_hidden_size=16,
        tie_word_embeddings=False,
        dtype="bfloat16",
    ).to_dict()
    # K2.5's config.json names its tower's sizes vt_* and the projector's mm_*/text_*: SGLang's
    # KimiK25ForConditionalGeneration builds both from them (transformers writes neither).
    text_hidden = sizes.get("hidden_size", _KIMI_MODEL_SIZES["hidden_size"])
    config["vision_config"].update(k25_vision_names(vision.to_dict(), text_hidden=text_hidden))
    config["architectures"] = ["KimiK25ForConditionalGeneration"]
    config["text_config"]["architectures"] = ["DeepseekV3ForCausalLM"]
    return config


def k25_vision_names(vision: dict[str, Any], *, text_hidden: int) -> dict[str, Any]:
    """The vision_config keys of K2.5's own config.json for a tower and projector of the
    sizes in ``vision`` (transformers' names), as SGLang 0.5.23 reads them."""
    return {
        "vt_hidden_size": vision["hidden_size"],
        "vt_num_attention_heads": vision["num_attention_heads"],
        "vt_num_hidden_layers": vision["num_hidden_layers"],
        "vt_intermediate_size": vision["intermediate_size"],
        "init_pos_emb_height": vision["pos_emb_height"],
        "init_pos_emb_width": vision["pos_emb_width"],
        "init_pos_emb_time": vision.get("pos_emb_time", 4),
        "pos_emb_type": "divided_fixed",
        "video_attn_type": "spatial_temporal",
        "merge_type": "sd2_tpool",
        "mm_projector_type": "patchmerger",
        "mm_hidden_size": vision["hidden_size"],
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-5,
        "text_hidden_size": text_hidden,
    }


def _save_kimi_wrapper(model: DeepseekV3ForCausalLM, out: Path, **sizes: Any) -> None:
    """Save the decoder under K2.5's checkpoint names (``language_model.model.*``,
    ``language_model.lm_head.*``), using the tensor names ``save_pretrained`` writes."""
    from safetensors.torch import load_file, save_file

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tensors = load_file(os.path.join(tmp, "model.safetensors"))
    wrapped = {"language_model." + name: tensor for name, tensor in tensors.items()}
    wrapped.update(_kimi_vision_tensors(model.config.hidden_size))
    save_file(wrapped, out / "model.safetensors", metadata={"format": "pt"})
    _write_json(out / "config.json", _kimi_wrapper_config(**sizes))
    model.generation_config.save_pretrained(out)


def make_kimi_dir(out: Path, *, wrapper: bool = False, k25_attention: bool = False) -> Path:
    """A complete Kimi-K2.5-shaped model directory at ``out`` (created if missing).

    ``wrapper=False``: a plain ``DeepseekV3ForCausalLM`` directory (what a text-only export
    looks like). ``wrapper=True``: the same weights saved as K2.5 ships them.
    ``k25_attention``: K2.5's MLA head dimensions at width 256 (:data:`K25_MLA_SIZES`)
    instead of the toy ones. Building takes about a second; nothing is cached outside
    ``out``.
    """
    out.mkdir(parents=True, exist_ok=True)
    _write_kimi_tokenizer(out)
    sizes = K25_MLA_SIZES if k25_attention else {}
    model = _kimi_random_decoder(**sizes)
    if wrapper:
        _save_kimi_wrapper(model, out, **sizes)
    else:
        model.save_pretrained(out)
    return out


def kimi_text_decoder(out: Path) -> DeepseekV3ForCausalLM:
    """The bare DeepSeek-V3 decoder of a ``make_kimi_dir`` directory, either variant.

    Independent of the main code's loading path: the decoder config is read straight from
    ``text_config`` (or the top level), the ``language_model.`` prefix is stripped from the
    tensor names and the rest (vision tower, projector) is dropped, then transformers loads
    the result as an ordinary checkpoint, so its own expert-weight conversion still applies.
    """
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = json.loads((out / "config.json").read_text())
    text = config.get("text_config", config)
    tensors = load_file(out / "model.safetensors")
    if "text_config" in config:
        prefix = "language_model."
        tensors = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    with tempfile.TemporaryDirectory() as tmp:
        DeepseekV3Config.from_dict(text).save_pretrained(tmp)
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        model = DeepseekV3ForCausalLM.from_pretrained(tmp, dtype="bfloat16")
    return model.eval()


def make_qwen3_dir(out: Path, *, head_dim: int = 16, layers: int = 8, context: int = 1024) -> Path:
    """A tiny random Qwen3 with the real Qwen3 thinking template (``enable_thinking``),
    ``context`` positions long.

    ``head_dim``: 16 by default; vLLM's CPU attention runs only 32 and up (its
    ``get_supported_head_sizes``), so ``tests/vllm/`` serves one with 32."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from support.chat_tokenizers import qwen3

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = qwen3()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=context,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def tiny_llama(
    tokenizer: PreTrainedTokenizerBase,
    *,
    tie_word_embeddings: bool = True,
    max_position_embeddings: int = 512,
    head_dim: int | None = None,
) -> LlamaForCausalLM:
    """The suite's random 8-layer Llama (hidden 64; 4 heads and 2 KV heads, so tensor
    parallel up to 2; heads of 16 unless ``head_dim``) for ``tokenizer``, seeded, in
    float32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim or 16,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


_LLAMA_HEAD_SCALE = 50.0


def make_llama_dir(out: Path, *, head_dim: int | None = None) -> Path:
    """A tiny random Llama with the SmolLM2 ChatML tokenizer and a head that writes words
    (heads of ``head_dim``: vLLM's CPU attention wants 32 or more).

    :func:`tiny_llama`, untied (SmolLM2-135M's 9 heads divide by no tp_size above 1). Like
    the Kimi fixture's, the head lets only whole-word tokens win, by a wide margin, so
    greedy picks are no near-ties that bf16 flips and the validate job's agreement check
    means something on a random model. With only 26 words, a plain scaled head repeats one
    word forever, which the one-token-shifted control then predicts as well as the target:
    so word ``i``'s head row is word ``i - 1``'s embedding (the residual stream of a random
    tiny model is mostly the input embedding), and greedy text walks the words in a cycle.
    """
    import torch

    from support.chat_tokenizers import smollm2

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = smollm2()
    model = tiny_llama(
        tokenizer, tie_word_embeddings=False, max_position_embeddings=1024, head_dim=head_dim
    )
    words = sorted(
        i
        for t, i in tokenizer.get_vocab().items()
        if t.startswith("Ġ") and t[1:].isalpha() and len(t) >= 4
    )
    embed = model.model.embed_tokens.weight
    with torch.no_grad():
        if head_dim is not None:
            # Wider heads put more of the context into the residual stream than the default
            # 16 (seen at 32: greedy text fell into a two-word loop): a quarter of the
            # attention output keeps the token's own embedding on top.
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(0.25)
        head = torch.zeros_like(model.lm_head.weight)
        for i, word in enumerate(words):
            previous = embed[words[i - 1]]
            head[word] = _LLAMA_HEAD_SCALE * previous / previous.norm()
        model.lm_head.weight.copy_(head)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# Final norms of three kinds, as the targets' own architectures build them.
NORM_TARGETS = {
    "rms": "LlamaForCausalLM",  # x * rsqrt(mean(x^2) + eps) * w: what speculators' teacher is
    "gemma": "GemmaForCausalLM",  # x * rsqrt(mean(x^2) + eps) * (1 + w)
    "layernorm": "StableLmForCausalLM",  # (x - mean) / std * w + b
}


def make_norm_target_dir(out: Path, norm: str) -> Path:
    """A tiny random 8-layer target whose final norm is ``norm`` (a key of
    :data:`NORM_TARGETS`), with the suite's SmolLM2 tokenizer, in float32. The final norm's
    weight (and bias) are drawn far from their init (weights 0.2-3 with a fifth negative),
    so a state put through the wrong norm, or none, is visibly wrong."""
    import torch
    from transformers import AutoModelForCausalLM, GemmaConfig, LlamaConfig, StableLmConfig

    from support.chat_tokenizers import smollm2

    tokenizer = smollm2()
    sizes = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    configs = {
        "rms": lambda: LlamaConfig(**sizes),
        "gemma": lambda: GemmaConfig(head_dim=16, **sizes),
        "layernorm": lambda: StableLmConfig(**sizes),
    }
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(configs[norm]())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    randomize_final_norm(out)
    return out


def randomize_final_norm(model_dir: Path, low: float = 0.2, high: float = 3.0) -> None:
    """Give the checkpoint's final norm a weight (and bias, if it has one) far from its init:
    ``low``-``high`` with a fifth negative, seeded; a wrapper's ``language_model.*`` too."""
    import torch
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(1)
    for suffix in ("model.norm.weight", "model.norm.bias"):
        keys = [k for k in tensors if k.endswith(suffix) and ".layers." not in k]
        assert len(keys) <= 1 and (keys or suffix.endswith("bias")), keys
        for key in keys:
            value = torch.empty(tensors[key].shape).uniform_(low, high, generator=gen)
            sign = torch.where(torch.rand(value.shape, generator=gen) < 0.2, -1.0, 1.0)
            tensors[key] = (value * sign).to(tensors[key].dtype)
    save_file(tensors, path, metadata={"format": "pt"})


def specforge_view(model_dir: Path, out: Path) -> Path:
    """The model directory as SpecForge's ``TargetHead`` loads it: it wants a
    ``*.index.json`` (a tied head is named with ``lm_head_key``)."""
    from safetensors import safe_open

    out.mkdir()
    for name in ("config.json", "model.safetensors"):
        (out / name).symlink_to(model_dir / name)
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return out


def forward_with_pre_norm(model: Any, ids: list[int]) -> tuple[Any, Any]:
    """``model``'s forward of one unpadded sample with ``output_hidden_states`` (whose last
    entry is the post-norm state), and its final norm's input: the pre-norm state [T, H]."""
    import torch

    seen: dict[str, Any] = {}
    norm = model.get_decoder().norm
    handle = norm.register_forward_hook(lambda m, i, o: seen.__setitem__("pre", i[0]))
    try:
        with torch.inference_mode():
            out = model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        handle.remove()
    return out, seen["pre"][0]
