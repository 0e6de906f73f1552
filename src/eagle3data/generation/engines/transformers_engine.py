"""In-process generation with transformers (CPU or one GPU), batched.

Rows of a batch are left-padded and generated together. Rows whose prompt plus
``max_tokens`` would not fit in the model context are generated alone, so a
long prompt never shortens its neighbours' completions.

A thinking target's completion is split into ``reasoning_content`` and ``content`` as
SGLang's reasoning parsers split it (:func:`..chat.split_reasoning`), so both backends
write the same rows. The think tags survive decoding even where a tokenizer marks them
special: they are decoded by id, the text between them as usual.

Tool calling: a conversation's ``tools`` are rendered by the chat template (``tools=``),
but tool calls are not parsed out of the completion: the model's raw output, tool-call
markup included (Qwen3's ``<tool_call>{...}</tool_call>``, Kimi's
``<|tool_calls_section_begin|>...``), is kept as ``content`` and no ``tool_calls`` are
returned. A later turn's history therefore carries the markup as text, which templates
render back as the model wrote it. Completions of conversations with tools are decoded
with special tokens kept, since some families (Kimi) mark their tool-call tokens special.

Token ids: each completion carries the prompt ids it was generated from and the ids it
generated, up to and including the token that ended it (the EOS, or the one that completed
a stop string), as SGLang and vLLM return them.

Images: for an image-text target (:func:`...target.is_image_text_model`), or given an image
source, the whole image-text model and its processor are loaded
(:func:`...target.load_image_text_model`); a conversation with images is rendered by the
chat template (one placeholder per image), expanded and given its pixels by the processor,
and generated alone; its prompt ids are the expanded ones, as the servers return them.

Progress: a batch of long completions can take minutes, and the driver logs only between
batches, so the engine logs how far the batch in hand has got every
``progress_interval_s`` (tokens per conversation so far, conversations finished).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from ...chat import THINK_CLOSE, THINK_OPEN, render, split_reasoning
from ...images import ImageSource, has_images, message_images, pil_image
from ...model_config import context_length
from ...target import is_image_text_model, load_causal_lm, load_image_text_model
from .protocol import OVER_CONTEXT, Completion, Message, Tools, TurnFailure

log = logging.getLogger(__name__)


class _BatchProgress(StoppingCriteria):
    """Logs a batch's progress every ``interval_s`` during ``generate``; stops nothing
    (transformers calls stopping criteria once per generated token)."""

    def __init__(
        self, label: str, prompt_width: int, max_new: int, eos_ids: list[int], interval_s: float
    ) -> None:
        self.label = label
        self.width = prompt_width
        self.max_new = max_new
        self.eos_ids = eos_ids
        self.interval_s = interval_s
        self.started = self.last = time.monotonic()

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        rows = input_ids.shape[0]
        now = time.monotonic()
        if now - self.last >= self.interval_s:
            self.last = now
            new = input_ids[:, self.width :]
            eos = torch.tensor(self.eos_ids, device=new.device)
            finished = int(torch.isin(new, eos).any(dim=1).sum())
            log.info(
                "%s: batch of %d: %d/%d tokens each so far, %d finished (%.0f s)",
                self.label,
                rows,
                new.shape[1],
                self.max_new,
                finished,
                now - self.started,
            )
        return torch.zeros(rows, dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]


class TransformersEngine:
    def __init__(
        self,
        model_path: str,
        *,
        sampling: Mapping[str, Any],
        chat_template_kwargs: Mapping[str, Any] | None = None,
        dtype: str = "auto",
        device: str = "auto",
        trust_remote_code: bool = False,
        progress_interval_s: float | None = None,
        label: str = "generation",
        images: ImageSource | None = None,
    ) -> None:
        self.progress_interval_s = progress_interval_s  # None: no progress within a batch
        self.label = label  # names the dataset in progress lines
        self.images = images  # the dataset's image table; None: text prompts only
        self.processor: Any = None
        # An image-text target runs whole, as capture runs it (some, Qwen-VL's, have a text
        # decoder that transformers builds only inside the image-text model).
        if images is None and not is_image_text_model(model_path):
            self.model, self.tokenizer = load_causal_lm(
                model_path, dtype=dtype, device=device, trust_remote_code=trust_remote_code
            )
        else:
            self.model, self.processor = load_image_text_model(
                model_path, dtype=dtype, device=device, trust_remote_code=trust_remote_code
            )
            self.tokenizer = self.processor.tokenizer
        self.sampling = dict(sampling)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        # The text decoder's context (a wrapper's top level declares none): 0 = unknown.
        self.context_length = context_length(self.model.config) or 0
        self.eos_ids = self._eos_ids()
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.eos_ids[0]
        self.think_tags = self._single_token_ids(THINK_OPEN, THINK_CLOSE)

    def _single_token_ids(self, *tags: str) -> dict[int, str]:
        """Ids of the tags the vocabulary holds as one token (none for most models)."""
        ids: dict[int, str] = {}
        for tag in tags:
            encoded = self.tokenizer.encode(tag, add_special_tokens=False)
            if len(encoded) == 1:
                ids[int(encoded[0])] = tag
        return ids

    def _decode(self, tokens: list[int], keep_special: bool = False) -> str:
        if keep_special:  # tool-call markup (see the module docstring); no EOS in ``tokens``
            return str(self.tokenizer.decode(tokens, skip_special_tokens=False))
        parts: list[str] = []
        run: list[int] = []
        for token in tokens:
            if token in self.think_tags:
                parts.append(self.tokenizer.decode(run, skip_special_tokens=True))
                parts.append(self.think_tags[token])
                run = []
            else:
                run.append(token)
        parts.append(self.tokenizer.decode(run, skip_special_tokens=True))
        return "".join(parts)

    def _eos_ids(self) -> list[int]:
        ids: list[int] = []
        for source in (self.model.generation_config.eos_token_id, self.tokenizer.eos_token_id):
            if source is None:
                continue
            for i in source if isinstance(source, list) else [source]:
                if i not in ids:
                    ids.append(int(i))
        if not ids:
            raise ValueError("the model declares no end-of-sequence token; cannot detect 'stop'")
        return ids

    def complete(
        self,
        conversations: Sequence[Sequence[Message]],
        *,
        seed: int,
        tools: Sequence[Tools | None] | None = None,
    ) -> list[Completion | TurnFailure]:
        results: list[Completion | TurnFailure | None] = [None] * len(conversations)
        prompts: list[list[int]] = []
        texts: list[str] = []
        with_images: dict[int, Mapping[str, torch.Tensor]] = {}  # row -> processor outputs
        offered = list(tools) if tools is not None else [None] * len(conversations)
        keep_special = [bool(t) for t in offered]
        for conv, conv_tools in zip(conversations, offered, strict=True):
            text = render(
                self.tokenizer,
                conv,
                add_generation_prompt=True,
                chat_template_kwargs=self.chat_template_kwargs,
                tools=conv_tools,
            )
            texts.append(text)
            if has_images(conv):
                inputs = self._image_inputs(text, conv)
                with_images[len(prompts)] = inputs
                prompts.append(inputs["input_ids"][0].tolist())
            else:
                prompts.append(self.tokenizer(text, add_special_tokens=False)["input_ids"])

        max_tokens = int(self.sampling["max_tokens"])
        batch: list[int] = []
        for i, ids in enumerate(prompts):
            if self.context_length and len(ids) >= self.context_length:
                results[i] = TurnFailure(
                    f"prompt has {len(ids)} tokens; the model context is {self.context_length}",
                    kind=OVER_CONTEXT,
                )
            elif i in with_images:  # alone: the pixels of a batch do not pad
                room = self.context_length - len(ids) if self.context_length else max_tokens
                results[i] = self._generate_images(
                    with_images[i], seed, min(max_tokens, room), keep_special[i]
                )
            elif self.context_length and len(ids) + max_tokens > self.context_length:
                max_new = self.context_length - len(ids)
                results[i] = self._generate([ids], seed, max_new, [keep_special[i]])[0]
            else:
                batch.append(i)
        if batch:
            outs = self._generate(
                [prompts[i] for i in batch], seed, max_tokens, [keep_special[i] for i in batch]
            )
            for i, out in zip(batch, outs, strict=True):
                results[i] = out
        return [
            self._split(texts[i], r) if isinstance(r, Completion) else r
            for i, r in enumerate(results)
            if r is not None
        ]

    @staticmethod
    def _split(prompt: str, completion: Completion) -> Completion:
        reasoning, content = split_reasoning(prompt, completion.content)
        if reasoning is None:
            return completion
        return dataclasses.replace(completion, content=content, reasoning_content=reasoning)

    @torch.inference_mode()
    def _generate(
        self, prompts: list[list[int]], seed: int, max_new: int, keep_special: list[bool]
    ) -> list[Completion]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, ids in enumerate(prompts):
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention[row, width - len(ids) :] = 1
        device = self.model.device
        torch.manual_seed(seed)
        out = self.model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention.to(device),
            **self._generate_kwargs(width, max_new),
        )
        new_tokens = out[:, width:].tolist()
        return [
            self._completion(tokens, p, max_new, keep)
            for tokens, p, keep in zip(new_tokens, prompts, keep_special, strict=True)
        ]

    def _image_inputs(self, text: str, conversation: Sequence[Message]) -> Any:
        """The processor's inputs for one rendered conversation: the image placeholders
        expanded, the pixels of its images in order."""
        assert self.images is not None and self.processor is not None
        images = [pil_image(self.images.get(sha)) for sha in message_images(conversation)]
        return self.processor(text=[text], images=images, return_tensors="pt")

    @torch.inference_mode()
    def _generate_images(
        self, inputs: Mapping[str, torch.Tensor], seed: int, max_new: int, keep_special: bool
    ) -> Completion:
        device, dtype = self.model.device, self.model.dtype
        # Pixels in the model's dtype: some vision towers (K2.5's) do not cast them.
        batch = {
            k: v.to(device, dtype) if v.is_floating_point() else v.to(device)
            for k, v in inputs.items()
            if isinstance(v, torch.Tensor)
        }
        prompt = batch["input_ids"][0].tolist()
        torch.manual_seed(seed)
        out = self.model.generate(**batch, **self._generate_kwargs(len(prompt), max_new))
        return self._completion(out[0, len(prompt) :].tolist(), prompt, max_new, keep_special)

    def _generate_kwargs(self, width: int, max_new: int) -> dict[str, Any]:
        """generate()'s sampling and stopping arguments."""
        s = self.sampling
        kwargs: dict[str, Any] = {"do_sample": s["temperature"] > 0}
        if kwargs["do_sample"]:
            kwargs.update(
                temperature=s["temperature"],
                top_p=s["top_p"],
                top_k=max(s["top_k"], 0),  # -1 (disabled, OpenAI style) is 0 here
            )
        if s["repetition_penalty"] != 1.0:
            kwargs["repetition_penalty"] = s["repetition_penalty"]
        if s["stop"]:
            kwargs.update(stop_strings=list(s["stop"]), tokenizer=self.tokenizer)
        if self.progress_interval_s is not None:
            progress = _BatchProgress(
                self.label, width, max_new, self.eos_ids, self.progress_interval_s
            )
            kwargs["stopping_criteria"] = StoppingCriteriaList([progress])
        kwargs.update(max_new_tokens=max_new, eos_token_id=self.eos_ids, pad_token_id=self.pad_id)
        return kwargs

    def _completion(
        self, tokens: list[int], prompt: list[int], max_new: int, keep_special: bool = False
    ) -> Completion:
        # Finished rows are padded (often with the EOS id itself), so the first
        # EOS ends the completion; it is counted, like servers count it.
        end = next((k for k, t in enumerate(tokens) if t in self.eos_ids), None)
        if end is not None:
            body, count, reason = tokens[:end], end + 1, "stop"
        else:
            body, count, reason = (
                tokens,
                len(tokens),
                "length" if len(tokens) >= max_new else "stop",
            )
        text = self._decode(body, keep_special)
        hits = [(text.find(stop), stop) for stop in self.sampling["stop"] if stop in text]
        if hits:
            cut, stop = min(hits)
            text = text[:cut]
            # Count tokens up to the one that completed the earliest stop string.
            count = next(
                k + 1
                for k in range(len(body))
                if stop in self.tokenizer.decode(body[: k + 1], skip_special_tokens=True)
            )
            reason = "stop"
        return Completion(
            content=text,
            finish_reason=reason,
            prompt_tokens=len(prompt),
            completion_tokens=count,
            prompt_ids=list(prompt),
            completion_ids=tokens[:count],  # the counted tokens: the EOS included
        )
