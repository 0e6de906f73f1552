"""Chat rendering and assistant-only loss masks, on real published chat templates.

Masking rule under test: a token is supervised iff it overlaps what the template renders
for an assistant turn after that turn's generation prompt, i.e. reasoning block (if the
template renders one there), content, end-of-turn token and any trailing newline.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest
import support.chat_tokenizers as fx
from support.workflow import REPO

from eagle3data.chat import (
    ChatTemplateError,
    TokenizedConversation,
    render,
    split_reasoning,
    tokenize_conversation,
    tokenize_text,
    training_samples,
)
from eagle3data.tokenizer_hashes import chat_template_hash, tokenizer_hash

SRC = REPO / "src"

USER_1 = "What is the capital of France?"
ANSWER_1 = "Paris is the capital of France."
USER_2 = "And of Germany?"
ANSWER_2 = "Berlin is the capital of Germany."
USER_3 = "Thanks!"
ANSWER_3 = "You are welcome."
SYSTEM = "You are a terse geography tutor."
SMOL_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
REASONING = "Let me think about the question."


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str, reasoning: str | None = None) -> dict[str, str]:
    message = {"role": "assistant", "content": text}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


def system(text: str = SYSTEM) -> dict[str, str]:
    return {"role": "system", "content": text}


def three_turns() -> list[dict[str, str]]:
    return [
        user(USER_1),
        assistant(ANSWER_1),
        user(USER_2),
        assistant(ANSWER_2),
        user(USER_3),
        assistant(ANSWER_3),
    ]


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def supervised_runs(tokenizer, tokenized: TokenizedConversation) -> list[str]:
    """Decoded text of each maximal run of consecutive mask-1 tokens."""
    runs: list[list[int]] = []
    previous = 0
    for token_id, bit in zip(tokenized.input_ids, tokenized.loss_mask, strict=True):
        if bit and not previous:
            runs.append([])
        if bit:
            runs[-1].append(token_id)
        previous = bit
    return [decode(tokenizer, run) for run in runs]


def assistant_char_spans(tokenizer, messages, **kwargs) -> tuple[str, list[tuple[int, int]]]:
    """The whole-conversation sample's text and spans (asserting there is one sample)."""
    (sample,) = training_samples(tokenizer, messages, **kwargs)
    assert sample.turn is None
    return sample.text, sample.spans


def one_sample(tokenizer, messages, **kwargs) -> TokenizedConversation:
    (tokenized,) = tokenize_conversation(tokenizer, messages, **kwargs)
    return tokenized


def check(tokenizer, messages, expected_runs: list[str], **kwargs) -> TokenizedConversation:
    """Tokenize as one sample and assert the supervised text is exactly ``expected_runs``."""
    tokenized = one_sample(tokenizer, messages, **kwargs)
    assert tokenized.turn is None
    if kwargs.get("reasoning") == "drop":
        messages = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages]
    # The mask is meaningful only if the ids reproduce the rendered text exactly.
    full = render(
        tokenizer,
        messages,
        add_generation_prompt=False,
        chat_template_kwargs=kwargs.get("chat_template_kwargs"),
    )
    assert decode(tokenizer, tokenized.input_ids) == full
    assert supervised_runs(tokenizer, tokenized) == expected_runs
    supervised_ids = [t for t, m in zip(tokenized.input_ids, tokenized.loss_mask, strict=True) if m]
    assert tokenized.num_loss_tokens == len(supervised_ids)
    assert decode(tokenizer, supervised_ids) == "".join(expected_runs)
    return tokenized


# --------------------------------------------------------------------------- SmolLM2 (ChatML)


def test_smollm2_render_matches_published_format():
    tok = fx.smollm2()
    prompt = render(tok, [user(USER_1)], add_generation_prompt=True)
    assert prompt == (
        f"<|im_start|>system\n{SMOL_DEFAULT_SYSTEM}<|im_end|>\n"
        f"<|im_start|>user\n{USER_1}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_smollm2_single_turn_without_system_prompt():
    tok = fx.smollm2()
    tokenized = check(tok, [user(USER_1), assistant(ANSWER_1)], [f"{ANSWER_1}<|im_end|>\n"])
    # The injected default system prompt and the header are context, not output.
    assert tokenized.loss_mask[0] == 0
    assert tokenized.input_ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_smollm2_single_turn_with_system_prompt():
    tok = fx.smollm2()
    text, spans = assistant_char_spans(tok, [system(), user(USER_1), assistant(ANSWER_1)])
    assert SMOL_DEFAULT_SYSTEM not in text
    assert [text[a:b] for a, b in spans] == [f"{ANSWER_1}<|im_end|>\n"]
    check(tok, [system(), user(USER_1), assistant(ANSWER_1)], [f"{ANSWER_1}<|im_end|>\n"])


def test_smollm2_multi_turn_masks_every_assistant_turn_and_nothing_else():
    tok = fx.smollm2()
    tokenized = check(
        tok,
        [system(), *three_turns()],
        [f"{ANSWER_1}<|im_end|>\n", f"{ANSWER_2}<|im_end|>\n", f"{ANSWER_3}<|im_end|>\n"],
    )
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ends = [m for t, m in zip(tokenized.input_ids, tokenized.loss_mask, strict=True) if t == im_end]
    # system, user, assistant, user, assistant, user, assistant
    assert ends == [0, 0, 1, 0, 1, 0, 1]
    assert all(
        m == 0
        for t, m in zip(tokenized.input_ids, tokenized.loss_mask, strict=True)
        if t == im_start
    )


def test_spans_are_char_exact_on_full_render():
    tok = fx.smollm2()
    text, spans = assistant_char_spans(tok, three_turns())
    assert text == render(tok, three_turns(), add_generation_prompt=False)
    assert [text[a:b] for a, b in spans] == [
        f"{ANSWER_1}<|im_end|>\n",
        f"{ANSWER_2}<|im_end|>\n",
        f"{ANSWER_3}<|im_end|>\n",
    ]
    # Each span starts right after the generation prompt.
    assert all(text[:a].endswith("<|im_start|>assistant\n") for a, _ in spans)


def test_special_tokens_get_literal_offsets():
    tok = fx.smollm2()
    text = render(tok, three_turns(), add_generation_prompt=False)
    encoding = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    specials = {tok.convert_tokens_to_ids(t): t for t in ("<|im_start|>", "<|im_end|>")}
    seen = 0
    for token_id, (a, b) in zip(encoding["input_ids"], encoding["offset_mapping"], strict=True):
        if token_id in specials:
            assert text[a:b] == specials[token_id]
            seen += 1
    assert seen == 2 * 7


def test_empty_assistant_content_still_supervises_end_of_turn():
    tok = fx.smollm2()
    check(
        tok,
        [user(USER_1), assistant(""), user(USER_2), assistant(ANSWER_2)],
        ["<|im_end|>\n", f"{ANSWER_2}<|im_end|>\n"],
    )


def test_conversation_without_assistant_turn_has_empty_mask():
    tok = fx.smollm2()
    tokenized = one_sample(tok, [user(USER_1)])
    assert tokenized.num_loss_tokens == 0
    assert set(tokenized.loss_mask) == {0}
    assert tokenized.input_ids


# --------------------------------------------------------------------------- Llama-3 / 3.1


def test_llama3_render_matches_published_format():
    tok = fx.llama3()
    text = render(tok, [system(), user(USER_1), assistant(ANSWER_1)], add_generation_prompt=False)
    assert text == (
        "<|begin_of_text|>"
        f"<|start_header_id|>system<|end_header_id|>\n\n{SYSTEM}<|eot_id|>"
        f"<|start_header_id|>user<|end_header_id|>\n\n{USER_1}<|eot_id|>"
        f"<|start_header_id|>assistant<|end_header_id|>\n\n{ANSWER_1}<|eot_id|>"
    )


@pytest.mark.parametrize("with_system", [False, True])
def test_llama3_multi_turn(with_system):
    tok = fx.llama3()
    messages = [system(), *three_turns()] if with_system else three_turns()
    tokenized = check(
        tok,
        messages,
        [f"{ANSWER_1}<|eot_id|>", f"{ANSWER_2}<|eot_id|>", f"{ANSWER_3}<|eot_id|>"],
    )
    bos = tok.convert_tokens_to_ids("<|begin_of_text|>")
    # The template writes BOS; tokenizing with add_special_tokens=False must not add another.
    assert tokenized.input_ids[0] == bos
    assert tokenized.input_ids.count(bos) == 1
    for name in ("<|start_header_id|>", "<|end_header_id|>"):
        token_id = tok.convert_tokens_to_ids(name)
        pairs = zip(tokenized.input_ids, tokenized.loss_mask, strict=True)
        assert all(m == 0 for t, m in pairs if t == token_id)


def test_llama3_supervises_trimmed_content():
    tok = fx.llama3()
    # The template trims content, so surrounding whitespace is neither rendered nor learned.
    check(tok, [user(USER_1), assistant(f"  {ANSWER_1} \n")], [f"{ANSWER_1}<|eot_id|>"])


def test_llama31_system_header_and_template_kwargs():
    tok = fx.llama31()
    messages = [system(), user(USER_1), assistant(ANSWER_1), user(USER_2), assistant(ANSWER_2)]
    kwargs = {"date_string": "01 Jan 2025"}
    text = render(tok, messages, add_generation_prompt=False, chat_template_kwargs=kwargs)
    assert text.startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 01 Jan 2025\n\n"
        f"{SYSTEM}<|eot_id|>"
    )
    check(
        tok,
        messages,
        [f"{ANSWER_1}<|eot_id|>", f"{ANSWER_2}<|eot_id|>"],
        chat_template_kwargs=kwargs,
    )


# --------------------------------------------------------------------------- Qwen3 (thinking)


def test_qwen3_reasoning_in_last_turn_is_supervised():
    tok = fx.qwen3()
    tokenized = check(
        tok,
        [user(USER_1), assistant(ANSWER_1, reasoning=REASONING)],
        [f"<think>\n{REASONING}\n</think>\n\n{ANSWER_1}<|im_end|>\n"],
    )
    think = tok.convert_tokens_to_ids("<think>")
    assert tokenized.loss_mask[tokenized.input_ids.index(think)] == 1


def test_qwen3_reasoning_inline_in_content_is_split_and_supervised():
    tok = fx.qwen3()
    check(
        tok,
        [user(USER_1), assistant(f"<think>\n{REASONING}\n</think>\n\n{ANSWER_1}")],
        [f"<think>\n{REASONING}\n</think>\n\n{ANSWER_1}<|im_end|>\n"],
    )


def test_qwen3_enable_thinking_false_leaves_injected_think_block_unsupervised():
    tok = fx.qwen3()
    kwargs = {"enable_thinking": False}
    prompt = render(tok, [user(USER_1)], add_generation_prompt=True, chat_template_kwargs=kwargs)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")

    tokenized = check(
        tok,
        [user(USER_1), assistant(ANSWER_1)],
        [f"{ANSWER_1}<|im_end|>\n"],
        chat_template_kwargs=kwargs,
    )
    for name in ("<think>", "</think>"):
        token_id = tok.convert_tokens_to_ids(name)
        assert token_id in tokenized.input_ids
        assert tokenized.loss_mask[tokenized.input_ids.index(token_id)] == 0


def test_qwen3_thinking_mode_without_reasoning_supervises_the_empty_think_block():
    # With thinking on, the generation prompt stops at "assistant\n": the (empty) think
    # block is what the model produced, so it is learned.
    tok = fx.qwen3()
    check(
        tok,
        [user(USER_1), assistant(ANSWER_1)],
        [f"<think>\n\n</think>\n\n{ANSWER_1}<|im_end|>\n"],
    )


def check_per_turn(tokenizer, messages, produced: dict[int, str], **kwargs) -> None:
    """One sample per assistant turn: the generation-time prompt, then exactly what the
    turn produced, and only that supervised."""
    samples = tokenize_conversation(tokenizer, messages, **kwargs)
    assert [s.turn for s in samples] == list(produced)
    template_kwargs = kwargs.get("chat_template_kwargs")
    for sample in samples:
        prompt = render(
            tokenizer,
            messages[: sample.turn],
            add_generation_prompt=True,
            chat_template_kwargs=template_kwargs,
        )
        assert decode(tokenizer, sample.input_ids) == prompt + produced[sample.turn]
        assert supervised_runs(tokenizer, sample) == [produced[sample.turn]]
        assert len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) == (
            sample.loss_mask.index(1)
        )


def test_qwen3_history_reasoning_dropped_by_the_template_makes_one_sample_per_turn():
    tok = fx.qwen3()
    messages = [
        system(),
        user(USER_1),
        assistant(ANSWER_1, reasoning="First thought."),
        user(USER_2),
        assistant(ANSWER_2, reasoning="Second thought."),
        user(USER_3),
        assistant(ANSWER_3, reasoning=REASONING),
    ]
    full = render(tok, messages, add_generation_prompt=False)
    assert "First thought." not in full
    assert "Second thought." not in full
    check_per_turn(
        tok,
        messages,
        {
            2: f"<think>\nFirst thought.\n</think>\n\n{ANSWER_1}<|im_end|>\n",
            4: f"<think>\nSecond thought.\n</think>\n\n{ANSWER_2}<|im_end|>\n",
            6: f"<think>\n{REASONING}\n</think>\n\n{ANSWER_3}<|im_end|>\n",
        },
    )


def test_qwen3_reasoning_dropped_by_the_user_is_one_sample():
    tok = fx.qwen3()
    messages = [
        user(USER_1),
        assistant(ANSWER_1, reasoning="First thought."),
        user(USER_2),
        assistant(ANSWER_2, reasoning=REASONING),
    ]
    tokenized = check(
        tok,
        messages,
        [f"{ANSWER_1}<|im_end|>\n", f"{ANSWER_2}<|im_end|>\n"],
        reasoning="drop",
        chat_template_kwargs={"enable_thinking": False},
    )
    assert "thought" not in decode(tok, tokenized.input_ids)


def test_qwen3_history_inline_reasoning_and_empty_content():
    tok = fx.qwen3()
    messages = [
        user(USER_1),
        assistant(f"<think>\nFirst thought.\n</think>\n\n{ANSWER_1}"),
        user(USER_2),
        assistant(""),
        user(USER_3),
        assistant(ANSWER_3),
    ]
    check_per_turn(
        tok,
        messages,
        {
            1: f"<think>\nFirst thought.\n</think>\n\n{ANSWER_1}<|im_end|>\n",
            3: "<think>\n\n</think>\n\n<|im_end|>\n",
            5: f"<think>\n\n</think>\n\n{ANSWER_3}<|im_end|>\n",
        },
    )


def test_qwen3_non_thinking_multi_turn():
    tok = fx.qwen3()
    check(
        tok,
        three_turns(),
        [f"{ANSWER_1}<|im_end|>\n", f"{ANSWER_2}<|im_end|>\n", f"{ANSWER_3}<|im_end|>\n"],
        chat_template_kwargs={"enable_thinking": False},
    )


# --------------------------------------------------------------------------- truncation


def test_truncation_cuts_ids_and_mask_together():
    tok = fx.smollm2()
    messages = three_turns()
    full = one_sample(tok, messages)
    assert full.num_tokens_before_truncation == len(full.input_ids)

    cut = len(full.input_ids) // 2
    short = one_sample(tok, messages, max_seq_len=cut)
    assert short.input_ids == full.input_ids[:cut]
    assert short.loss_mask == full.loss_mask[:cut]
    assert short.num_tokens_before_truncation == len(full.input_ids)
    assert 0 < short.num_loss_tokens < full.num_loss_tokens

    roomy = one_sample(tok, messages, max_seq_len=10 * len(full.input_ids))
    assert roomy == full


@pytest.mark.parametrize("bad", [0, -3])
def test_max_seq_len_must_be_positive(bad):
    with pytest.raises(ValueError, match="max_seq_len"):
        tokenize_conversation(fx.smollm2(), three_turns(), max_seq_len=bad)


# --------------------------------------------------------------------------- errors

# ChatML, but earlier assistant turns are replaced by a placeholder, so the rendered
# output of turn 1 cannot be found in the full conversation.
REDACTING_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' and not loop.last %}{{ '[redacted]' }}"
    "{% else %}{{ message['content'] }}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_history_the_template_rewrites_is_trained_turn_by_turn():
    tok = fx.make_tokenizer(REDACTING_TEMPLATE, "smollm2")
    # Single-turn: the last turn is rendered verbatim, one sample.
    check(tok, [user(USER_1), assistant(ANSWER_1)], [f"{ANSWER_1}<|im_end|>\n"])
    # The full render holds "[redacted]" for turns 1 and 3: each turn is its own sample.
    check_per_turn(
        tok,
        three_turns(),
        {
            1: f"{ANSWER_1}<|im_end|>\n",
            3: f"{ANSWER_2}<|im_end|>\n",
            5: f"{ANSWER_3}<|im_end|>\n",
        },
    )


def test_reasoning_a_template_cannot_place_is_an_error_naming_the_turn():
    # ChatML renders no reasoning and opens no think block: keeping it is impossible.
    with pytest.raises(ChatTemplateError, match=r"turn 1 \(assistant\).*reasoning: drop"):
        tokenize_conversation(fx.smollm2(), [user(USER_1), assistant(ANSWER_1, REASONING)])
    check(
        fx.smollm2(),
        [user(USER_1), assistant(ANSWER_1, REASONING)],
        [f"{ANSWER_1}<|im_end|>\n"],
        reasoning="drop",
    )


@pytest.mark.parametrize(
    ("messages", "pattern"),
    [
        ([], "at least one message"),
        ([assistant(ANSWER_1)], r"turn 0: expected a user message, got assistant"),
        ([system(), assistant(ANSWER_1)], r"turn 1: expected a user message"),
        ([user(USER_1), user(USER_2)], r"turn 1: expected a assistant message, got user"),
        ([user(USER_1), assistant(ANSWER_1), system()], r"turn 2: a system message"),
        ([user(USER_1), {"role": "tool", "content": "x"}], r"turn 1: expected a assistant message"),
        ([user(USER_1), {"role": "function", "content": "x"}], r"turn 1: role must be one of"),
        ([user(USER_1), {"role": "assistant", "content": None}], r"turn 1 \(assistant\): content"),
        ([{**user(USER_1), "reasoning_content": "x"}], r"turn 0 \(user\): reasoning_content"),
    ],
)
def test_invalid_conversations_are_rejected(messages, pattern):
    with pytest.raises(ChatTemplateError, match=pattern):
        tokenize_conversation(fx.smollm2(), messages)


def test_template_failure_is_wrapped():
    tok = fx.make_tokenizer("{{ raise_exception('no system prompts here') }}", "smollm2")
    with pytest.raises(ChatTemplateError, match="no system prompts here"):
        render(tok, [user(USER_1)], add_generation_prompt=True)


def test_reserved_template_kwargs_are_rejected():
    with pytest.raises(ValueError, match="add_generation_prompt"):
        render(
            fx.smollm2(),
            [user(USER_1)],
            add_generation_prompt=True,
            chat_template_kwargs={"add_generation_prompt": False},
        )


class _SlowTokenizer:
    """A Python (slow) tokenizer stand-in: the same ids as ``inner``, but no offsets."""

    is_fast = False

    def __init__(self, inner):
        self._inner = inner

    def apply_chat_template(self, *args, **kwargs):
        return self._inner.apply_chat_template(*args, **kwargs)

    def encode(self, text, add_special_tokens=True):
        return self._inner.encode(text, add_special_tokens=add_special_tokens)


def test_slow_tokenizer_masks_equal_the_offset_masks():
    fast = fx.qwen3()
    slow = _SlowTokenizer(fast)
    messages = [system(), *three_turns()]
    messages[-1] = assistant(ANSWER_3, reasoning=REASONING)
    assert tokenize_conversation(slow, messages) == tokenize_conversation(fast, messages)
    messages[2] = assistant(ANSWER_1, reasoning="First thought.")  # now one sample per turn
    per_turn = tokenize_conversation(slow, messages)
    assert len(per_turn) == 3
    assert per_turn == tokenize_conversation(fast, messages)


class _TiktokenTokenizer:
    """A slow tokenizer on a tiktoken Encoding, like Kimi's: bytes, but no offsets."""

    is_fast = False

    def __init__(self, merges: list[bytes]):
        import tiktoken

        ranks = {bytes([i]): i for i in range(256)}
        ranks.update({m: 256 + k for k, m in enumerate(merges)})
        self.model = tiktoken.Encoding(
            name="test", pat_str=r"[^\n]+|\n", mergeable_ranks=ranks, special_tokens={}
        )

    def encode(self, text, add_special_tokens=True):
        return self.model.encode(text)


def test_a_token_across_a_span_boundary_is_placed_by_its_bytes():
    tok = _TiktokenTokenizer([b"ab", "é".encode()[:1] + b"x"])
    # "ab" is one token, the span starts between "a" and "b": the token overlaps it.
    ids, mask = tokenize_text(tok, "xxab", [(3, 4)])
    assert ids == tok.encode("xxab")
    assert len(ids) == 3
    assert mask == [0, 0, 1]
    # A character of two bytes split across tokens belongs to both.
    ids, mask = tokenize_text(tok, "aé", [(1, 2)])
    assert ids == tok.encode("aé")
    assert mask == [0] + [1] * (len(ids) - 1)


def test_a_slow_tokenizer_without_bytes_across_a_boundary_is_an_error():
    class Pairs:
        is_fast = False

        def encode(self, text, add_special_tokens=True):
            return [hash(text[i : i + 2]) for i in range(0, len(text), 2)]

    with pytest.raises(ChatTemplateError, match="crosses the boundary"):
        tokenize_text(Pairs(), "xxab", [(3, 4)])


# --------------------------------------------------------------------------- hashes


def test_chat_template_hash_is_sha256_of_template_text():
    tok = fx.qwen3()
    expected = hashlib.sha256(fx.QWEN3_TEMPLATE.encode("utf-8")).hexdigest()
    assert chat_template_hash(tok) == expected
    assert chat_template_hash(fx.qwen3()) == expected
    assert chat_template_hash(fx.smollm2()) != expected


def test_tokenizer_hash_ignores_template_and_runtime_state_but_not_vocab():
    reference = tokenizer_hash(fx.smollm2())
    assert len(reference) == 64
    # Same backend and special tokens, different template: same tokenizer.
    tok = fx.make_tokenizer(fx.QWEN3_TEMPLATE, "smollm2")
    assert tokenizer_hash(tok) == reference
    # Truncation/padding settings are toggled on the backend by ordinary calls.
    tok("What is the capital of France?", truncation=True, max_length=3)
    assert tokenizer_hash(tok) == reference
    tok.add_tokens(["<extra_token>"])
    assert tokenizer_hash(tok) != reference
    assert tokenizer_hash(fx.llama3()) != reference  # different special-token map


def test_tokenizer_hash_is_stable_across_save_and_processes(tmp_path):
    tok = fx.qwen3()
    tok.save_pretrained(tmp_path)
    expected = tokenizer_hash(tok)

    code = (
        "import sys\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "from eagle3data.tokenizer_hashes import chat_template_hash, tokenizer_hash\n"
        "tok = PreTrainedTokenizerFast.from_pretrained(sys.argv[1])\n"
        "print(tokenizer_hash(tok), chat_template_hash(tok))\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    env["PYTHONHASHSEED"] = "12345"  # a different str-hash seed must not matter
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=120,
    )
    assert result.stdout.split() == [expected, chat_template_hash(tok)]


# --------------------------------------------------------------------------- reasoning split


@pytest.mark.parametrize(
    ("prompt", "completion", "expected"),
    [
        # Kimi-K2.5: the prompt opened the block, the model closes it.
        ("<|im_middle|><think>", "Hmm, 2+2.</think>It is 4.", ("Hmm, 2+2.", "It is 4.")),
        # Qwen3 thinking: the model opens it itself; whitespace as the parsers strip it.
        ("assistant\n", "<think>\nHmm.\n</think>\n\nFour.", ("Hmm.\n", "Four.")),
        # Cut off while thinking: all reasoning, no content.
        ("<|im_middle|><think>", "Still thinking", ("Still thinking", "")),
        # Thinking off (Kimi) or a template without thinking: untouched.
        ("<|im_middle|><think></think>", "Four.", (None, "Four.")),
        ("assistant\n", "Four.</think>", (None, "Four.</think>")),
    ],
)
def test_split_reasoning_as_the_servers_parsers_do(prompt, completion, expected):
    assert split_reasoning(prompt, completion) == expected
