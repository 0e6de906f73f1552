"""Hidden-state capture through a vLLM server's own extraction (vLLM >= 0.18).

The server is one the user runs (``hidden_states.vllm.url``), started with vLLM's
``extract_hidden_states`` speculative method and a hidden-state KV connector
(:func:`serve_command` prints the flags for a config). vLLM then writes, for every request
it finishes, one safetensors file into the connector's ``shared_storage_path``:
``hidden_states`` ``[T, layers, H]`` and ``token_ids`` ``[T]``, and answers with its path in
``kv_transfer_params.hidden_states_path``. The capture asks for the states of each
conversation with ``POST /v1/completions`` (the token ids as the prompt, one new token),
reads the file named in the answer (waiting on its ``.lock``, as vLLM's own reader does),
checks it, and deletes it.

Why a server the user runs rather than an engine per job: vLLM lays out tensor, pipeline,
data and expert parallelism itself, across nodes, from its own flags; one server serves
every shard job (a 1-T-parameter target loads once, not once per shard) and, when the user
wants it, the generate stage as well. The price is that the job must read the server's
files: it runs on the server's machine, or where its ``shared_storage_path`` is mounted.

The layer ids are vLLM's: id ``k`` is transformers' ``hidden_states[k]`` (0 = embeddings),
and the id equal to the number of layers is the last layer's output before the final norm.
The capture asks for the three aux layers' indices and that one, so the shards hold the
pre-norm final state natively; ``final_state: post_norm`` applies the target's own final
norm (:mod:`.final_state`) here.

Samples with images go to vLLM's token-in-token-out route, ``POST /inference/v1/generate``
(on a server started with ``--enable-scale-out``): the sample's ids with each image's run of
image tokens folded back to the one placeholder the chat template wrote, and the images as
``content_parts``. vLLM runs its own processor on them and expands each placeholder again, so
the vision tower sees the pixels and every text position after an image sees the image; the
file's ``token_ids`` must then equal the sample's ids, the expansion checked token by token.
(``/v1/completions`` takes token ids or images, not both.)

What cannot be seen from the client is checked on a probe request before any work: that
the server extracts at all, that its files are readable here, the layers its storage folder
states (:func:`layers_folder`: vLLM says them nowhere else), their number and width, and the
dtype; then the same on every answer (a run's capture engine keeps one client for all its
shards, and the server may be restarted with other flags meanwhile).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from .. import model_config
from ..errors import VLLMCaptureError
from ..images import data_uri
from ..schema import schema_defaults
from ..servers.http import (
    RETRY_STATUS,
    TransientError,
    error_message,
    json_or_none,
    model_entries,
    served_context_length,
)
from ..servers.vllm_files import discard_states, read_states
from ..target import check_remote_code
from ..tokenization.samples import collapsed, image_runs
from ..torch_utils import TORCH_DTYPES
from .engine_target import read_engine_target
from .final_state import POST_NORM, PRE_NORM, load_final_norm
from .layers import AuxLayers, resolve_aux_layers

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image

log = logging.getLogger(__name__)

STOCK_CONNECTOR = "ExampleHiddenStatesConnector"
# The prompt of the probe request: two tokens of any id the vocabulary has.
_PROBE_IDS = [0, 1]


def vllm_layer_ids(aux: AuxLayers) -> list[int]:
    """``eagle_aux_hidden_state_layer_ids`` for ``aux``: the three aux layers as
    ``hidden_states`` indices, then the number of layers (the pre-norm final state)."""
    return [*aux.hidden_states_indices, aux.num_layers]


def speculative_config(layer_ids: Sequence[int]) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` that captures ``layer_ids`` (vLLM's numbering)."""
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
    }


# vLLM states its capture layers in no answer and no file: the capture server's storage
# folder, which every answer names, is named after them by the command we print, so the
# server itself says which layers it was started with. A folder named otherwise is refused.
_LAYERS_FOLDER = re.compile(r"^eagle3data-layers-(\d+(?:-\d+)*)$")


def layers_folder(layer_ids: Sequence[int]) -> str:
    """The name of a capture server's storage folder that states its ``layer_ids``."""
    return "eagle3data-layers-" + "-".join(str(i) for i in layer_ids)


def stated_layers(storage: Path) -> list[int] | None:
    """The layer ids a storage folder's name states, or None when it states none."""
    match = _LAYERS_FOLDER.match(storage.name)
    return [int(i) for i in match[1].split("-")] if match else None


def kv_transfer_config(storage: str, connector: Mapping[str, str] | None = None) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` writing the states into ``storage``: vLLM's stock
    connector, or ``connector`` (``{"name": class, "module": module path}``)."""
    config: dict[str, Any] = {
        "kv_connector": STOCK_CONNECTOR,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": storage},
    }
    if connector is not None:
        config["kv_connector"] = connector["name"]
        config["kv_connector_module_path"] = connector["module"]
    return config


# The route that takes token ids and images together (vLLM's scale-out routes, off unless the
# server is started with the flag below).
TOKENS_ROUTE = "/inference/v1/generate"
TOKENS_ROUTE_FLAG = "--enable-scale-out"
# What vLLM names each request's file after: "{prefix}-{request id}-{suffix}.safetensors".
_FILE_PREFIXES = ("cmpl-", "generate-tokens-")


def serve_command(
    model: str, aux: AuxLayers, storage: str, *, images: bool = False, extra: Sequence[str] = ()
) -> list[str]:
    """The ``vllm serve`` command of a capture server for ``aux``, writing into a folder
    of ``storage`` named after the layers it captures (:func:`layers_folder`); ``images``:
    the target takes images, whose samples go to :data:`TOKENS_ROUTE`."""
    layer_ids = vllm_layer_ids(aux)
    return [
        "vllm",
        "serve",
        model,
        "--speculative-config",
        json.dumps(speculative_config(layer_ids)),
        "--kv-transfer-config",
        json.dumps(kv_transfer_config(str(Path(storage) / layers_folder(layer_ids)))),
        *([TOKENS_ROUTE_FLAG] if images and TOKENS_ROUTE_FLAG not in extra else []),
        *extra,
    ]


def png_bytes(image: Image) -> bytes:
    """The picture as PNG: lossless, so the server decodes the pixels the processor here
    was given."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


# What a generation server of the target needs beyond the capture's flags, by the
# architecture its config.json names: a reasoning parser (the reasoning apart from the
# content, which the rows keep as reasoning_content) and a tool-call parser (calls as
# tool_calls), as vLLM 0.32 names them. Kimi-K2.5: vLLM's recipe for the model, its
# "kimi_k2" reasoning and tool-call parsers. Only targets whose parsers are known for sure:
# an architecture can carry several models that need different ones (Qwen3's thinking and
# instruct releases, Qwen3-Coder's own tool-call format), and a wrong reasoning parser
# moves answers into the reasoning.
GENERATION_PARSERS: dict[str, tuple[str, ...]] = {
    "KimiK25ForConditionalGeneration": (
        "--reasoning-parser",
        "kimi_k2",
        "--tool-call-parser",
        "kimi_k2",
    ),
}


def generation_flags(architectures: Sequence[str]) -> list[str] | None:
    """The ``vllm serve`` flags a generation server of a target of ``architectures`` needs
    (vLLM parses tool calls only with ``--enable-auto-tool-choice``), or None when this
    package does not know them."""
    for name in architectures:
        parsers = GENERATION_PARSERS.get(name)
        if parsers is not None:
            return [*parsers[:2], "--enable-auto-tool-choice", *parsers[2:]]
    return None


def request_prefix(job: str) -> str:
    """The request ids of one job's captures start with this (vLLM names each file after
    its request, so a resumed job finds the files a killed attempt left behind, and deletes
    every file starting so). A fixed-width hash of the job's name comes first, so no job's
    prefix starts another's (dataset ``A-1`` shard 0 against ``A-1-0`` shard 5, or two
    names that sanitise alike); the name follows for people reading the folder."""
    digest = hashlib.sha256(job.encode()).hexdigest()[:12]
    return f"eagle3data-{digest}-" + re.sub(r"[^A-Za-z0-9_.-]", "_", job) + "-"


def _error_text(status: int, text: str) -> str:
    return f"HTTP {status}: {error_message(json_or_none(text), text)}"


class VLLMCapture:
    """An :class:`~.backends.Extractor` on a vLLM capture server."""

    def __init__(
        self,
        model_path: str,
        *,
        aux_layers: str | Sequence[int] = "auto",
        convention: str = "layer_output",
        dtype: str = "auto",
        options: Mapping[str, Any] | None = None,
        trust_remote_code: bool = False,
        final_state: str = PRE_NORM,
        job: str = "capture",
    ) -> None:
        check_remote_code(model_path, trust_remote_code)
        target = read_engine_target(
            model_path,
            aux_layers=aux_layers,
            convention=convention,
            dtype=dtype,
            final_state=final_state,
            error=VLLMCaptureError,
        )
        # The config's section holds every default; given by hand, the schema's fill it.
        opts = {**schema_defaults("hidden_states", "vllm"), **(options or {})}
        if not opts.get("url"):
            raise VLLMCaptureError(
                "hidden_states.backend is vllm but hidden_states.vllm.url is not set: name the "
                "capture server's OpenAI base URL, e.g. http://gpu-node-1:8000/v1"
            )
        self.aux: AuxLayers = target.aux
        self.hidden_size = target.hidden_size
        self.image_token = model_config.image_token_id(target.config)
        self.dtype: torch.dtype = TORCH_DTYPES[target.dtype_name]
        self.final_state = final_state
        self.layer_ids = vllm_layer_ids(self.aux)
        self.url = str(opts["url"]).rstrip("/")
        self.options = opts
        self.model_path = model_path
        self.prefix = request_prefix(job)
        self._count = 0
        self._norm = (
            load_final_norm(model_path, dtype=self.dtype, trust_remote_code=trust_remote_code)
            if final_state == POST_NORM
            else None
        )
        self._loop = asyncio.new_event_loop()
        self._session: aiohttp.ClientSession | None = None
        try:
            self.model_name, self.max_model_len = self._loop.run_until_complete(self._start())
            self.server_version = self._loop.run_until_complete(self._version())
            self.storage = self._probe()
        except BaseException:
            self.close()
            raise

    def _describe(self) -> None:
        log.info(
            "vllm capture server %s (model %s, max_model_len %s): layers %s (aux layer outputs "
            "%s, then the pre-norm final state), files in %s",
            self.url,
            self.model_name,
            self.max_model_len,
            self.layer_ids,
            list(self.aux.layer_ids),
            self.storage,
        )

    def begin_shard(self, name: str) -> None:
        """Name the next requests after the shard ``name`` (not after this client, which a
        capture engine keeps for a whole run) and delete what a killed attempt at this
        shard left in the storage: its requests still finished and were saved."""
        self.prefix = request_prefix(name)
        for kind in _FILE_PREFIXES:
            for stale in self.storage.glob(f"{kind}{self.prefix}*.safetensors"):
                discard_states(str(stale))
        self._describe()  # in each shard's log, also when a capture engine runs it

    # -- set-up --------------------------------------------------------------------------

    def _serve_hint(self) -> str:
        command = serve_command(
            self.model_path,
            self.aux,
            "/path/on/a/disk/the/job/reads",
            images=self.image_token is not None,
        )
        return "start it as: " + shlex.join(command)

    async def _start(self) -> tuple[str, int | None]:
        headers = {"Content-Type": "application/json"}
        if self.options["api_key_env"]:
            key = os.environ.get(self.options["api_key_env"])
            if not key:
                raise VLLMCaptureError(
                    f"hidden_states.vllm.api_key_env names {self.options['api_key_env']}, "
                    f"which is not set"
                )
            headers["Authorization"] = f"Bearer {key}"
        self._session = aiohttp.ClientSession(
            headers=headers,
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=float(self.options["request_timeout_s"])),
        )
        url = f"{self.url}/models"
        try:
            async with self._session.get(url) as resp:
                text = await resp.text()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise VLLMCaptureError(
                f"hidden_states.vllm.url: GET {url} failed ({type(exc).__name__}: {exc}); "
                f"is the capture server up? {self._serve_hint()}"
            ) from None
        if status != 200:
            raise VLLMCaptureError(f"GET {url} -> {_error_text(status, text)}")
        models = model_entries(json_or_none(text))
        if models is None:
            raise VLLMCaptureError(
                f"GET {url} answered HTTP 200 with a body that is not a model list "
                f"({text[:120]!r}): is hidden_states.vllm.url the server's OpenAI base URL "
                f"(ending in /v1)?"
            )
        wanted = self.options["model"]
        if wanted is None and len(models) == 1:
            chosen = models[0]
        else:
            chosen = next((m for m in models if m.get("id") == wanted), None)
            if chosen is None:
                names = [m.get("id") for m in models]
                raise VLLMCaptureError(
                    f"{self.url} serves {names}; set hidden_states.vllm.model to the target's "
                    f"name there"
                    if wanted is None
                    else f"{self.url} serves {names}, not hidden_states.vllm.model {wanted!r}"
                )
        return str(chosen["id"]), served_context_length(chosen)

    async def _version(self) -> str | None:
        """The server's vLLM version (``GET /version``, vLLM's own route); None if unsaid."""
        assert self._session is not None
        url = f"{self.url.removesuffix('/v1')}/version"
        try:
            async with self._session.get(url) as resp:
                payload = json_or_none(await resp.text()) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError):
            return None
        version = payload.get("version") if isinstance(payload, dict) else None
        return str(version) if version else None

    def capture_fingerprint(self) -> dict[str, Any]:
        """The engine's part of the shards' fingerprint (:mod:`.fingerprint`)."""
        return {
            "engine": f"vllm {self.server_version or '(version not reported)'}",
            "layout": "vllm server (its layout is not reported)",
            "aux_layers_confirmed_by": f"the server's storage folder ({self.storage.name})",
        }

    def _probe(self) -> Path:
        """Capture two tokens and check the answer; the server's storage folder."""
        path, tensors = self._loop.run_until_complete(self._capture(_PROBE_IDS, probe=True))
        return self._checked(path, tensors)

    def _checked(self, path: str, tensors: Mapping[str, torch.Tensor]) -> Path:
        """The storage folder of an answer whose layers, width and dtype are this config's.
        Every answer is checked, not only the probe's: a capture engine keeps its client for
        the whole run, and the server may be restarted with other flags in the meantime."""
        storage = Path(path).parent
        stated = stated_layers(storage)
        if stated != self.layer_ids:
            said = (
                f"its storage folder {storage} states layers {stated}"
                if stated is not None
                else f"it writes into {storage}, a folder whose name does not state the "
                f"layers it captures (vLLM says them nowhere else)"
            )
            raise VLLMCaptureError(
                f"{self.url}: {said}; this config captures layers {self.layer_ids} "
                f"(hidden_states.aux_layers, then the final state); {self._serve_hint()}"
            )
        states = tensors["hidden_states"]
        expected = (len(self.layer_ids), self.hidden_size)
        if tuple(states.shape[1:]) != expected:
            got = tuple(states.shape)
            if got[1] != expected[0]:
                problem = f"{got[1]} layers, not the {len(self.layer_ids)} ({self.layer_ids})"
            else:
                problem = f"width {got[2]}, not the target's hidden size {self.hidden_size}"
            raise VLLMCaptureError(
                f"{self.url} captured states of shape {list(got)}: {problem} this config "
                f"needs; {self._serve_hint()}"
            )
        if states.dtype != self.dtype:
            raise VLLMCaptureError(
                f"{self.url} computes in {str(states.dtype).removeprefix('torch.')}, but "
                f"hidden_states.dtype is {str(self.dtype).removeprefix('torch.')}: start the "
                f"server with --dtype {str(self.dtype).removeprefix('torch.')}, or set "
                f"hidden_states.dtype to the server's"
            )
        return storage

    # -- capture -------------------------------------------------------------------------

    def _request(
        self, ids: Sequence[int], request_id: str, images: Sequence[Image]
    ) -> tuple[str, dict[str, Any]]:
        """The URL and body that ask for the states of ``ids`` (with ``images``: on the
        token route, the placeholders folded back for vLLM to expand)."""
        if not images:
            body = {
                "model": self.model_name,
                "prompt": list(ids),
                "max_tokens": 1,
                "temperature": 0.0,
                "request_id": request_id,
            }
            return f"{self.url}/completions", body
        if self.image_token is None:
            raise VLLMCaptureError(
                f"a sample has images, but {self.model_path}'s config names no image token: "
                f"is the target an image-text model?"
            )
        # Each run of image tokens folded to one: the prompt as the chat template wrote it,
        # one placeholder per image, before the processor expanded each.
        prompt = collapsed(ids, self.image_token)
        placeholders = image_runs(ids, self.image_token)
        if placeholders != len(images):
            raise VLLMCaptureError(
                f"a sample of {len(images)} images holds {placeholders} runs of image tokens "
                f"(id {self.image_token}): two images whose tokens touch cannot be told apart "
                f"for vLLM to expand them again"
            )
        body = {
            "model": self.model_name,
            "token_ids": prompt,
            "content_parts": [
                {"type": "image_url", "url": data_uri(png_bytes(image), "image/png")}
                for image in images
            ],
            "sampling_params": {"max_tokens": 1, "temperature": 0.0},
            "request_id": request_id,
        }
        return f"{self.url.removesuffix('/v1')}{TOKENS_ROUTE}", body

    async def _post(self, ids: Sequence[int], request_id: str, images: Sequence[Image] = ()) -> str:
        """The path of the states of ``ids``, as the server answers it."""
        assert self._session is not None
        url, body = self._request(ids, request_id, images)
        try:
            async with self._session.post(url, json=body) as resp:
                text = await resp.text()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise TransientError(f"POST {url}: {type(exc).__name__}: {exc}") from exc
        if status in RETRY_STATUS:
            raise TransientError(f"POST {url} -> {_error_text(status, text)}")
        if status != 200:
            hint = ""
            if images and status in (403, 404):
                hint = (
                    f"; samples with images need the server's token route: start it with "
                    f"{TOKENS_ROUTE_FLAG} ({self._serve_hint()})"
                )
            raise VLLMCaptureError(
                f"POST {url} ({len(ids)} tokens) -> {_error_text(status, text)}{hint}"
            )
        payload = json_or_none(text)
        if not isinstance(payload, dict):
            raise TransientError(f"POST {url}: HTTP 200 with a body that is not a JSON object")
        params = payload.get("kv_transfer_params") or {}
        path = params.get("hidden_states_path")
        if not path:
            raise VLLMCaptureError(
                f"{self.url} answered without kv_transfer_params.hidden_states_path: it does "
                f"not extract hidden states; {self._serve_hint()}"
            )
        return str(path)

    async def _capture(
        self, ids: Sequence[int], images: Sequence[Image] = (), *, probe: bool = False
    ) -> tuple[str, dict[str, torch.Tensor]]:
        self._count += 1
        request_id = f"{self.prefix}{'probe' if probe else self._count}"
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(TransientError),
            stop=stop_after_attempt(int(self.options["max_retries"]) + 1),
            wait=wait_exponential(multiplier=1, max=30),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    path = await self._post(ids, request_id, images)
        except TransientError as exc:
            raise VLLMCaptureError(f"{exc} (after {self.options['max_retries']} retries)") from None
        try:
            tensors = await asyncio.to_thread(read_states, path)
        except FileNotFoundError:
            raise VLLMCaptureError(
                f"the server wrote the states to {path}, which this job cannot read: run the "
                f"hidden_states jobs where the server's shared_storage_path is (same machine "
                f"or a shared filesystem)"
            ) from None
        finally:
            await asyncio.to_thread(discard_states, path)
        token_ids = tensors["token_ids"].tolist()
        if token_ids != list(ids):
            first = next(
                (k for k, (a, b) in enumerate(zip(token_ids, ids, strict=False)) if a != b),
                min(len(token_ids), len(ids)),
            )
            how = (
                "vLLM expanded the images' placeholders otherwise than the sample's processor"
                if images
                else "other tokens than asked for"
            )
            raise VLLMCaptureError(
                f"{path} holds the states of {len(token_ids)} tokens for a sample of "
                f"{len(ids)}: {how} (first difference at position {first}: "
                f"{token_ids[first : first + 8]} vs {list(ids)[first : first + 8]})"
            )
        if tensors["hidden_states"].shape[0] != len(ids):
            raise VLLMCaptureError(
                f"{path} holds {tensors['hidden_states'].shape[0]} rows of states for "
                f"{len(ids)} tokens"
            )
        return path, tensors

    async def _capture_all(
        self, samples: Sequence[Sequence[int]], images: Sequence[Sequence[Image]]
    ) -> list[torch.Tensor]:
        limit = asyncio.Semaphore(int(self.options["max_in_flight"]))

        async def one(ids: Sequence[int], pictures: Sequence[Image]) -> torch.Tensor:
            async with limit:
                path, tensors = await self._capture(ids, pictures)
            self._checked(path, tensors)
            return tensors["hidden_states"]

        tasks = [
            asyncio.ensure_future(one(ids, pictures))
            for ids, pictures in zip(samples, images, strict=True)
        ]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    def _check_context(self, samples: Sequence[Sequence[int]]) -> None:
        """Refuse, before any request, samples the server's context cannot take (it would
        answer each with a 400, and every retry of the shard the same)."""
        context = self.max_model_len
        if not isinstance(context, int) or not samples:
            return
        longest = max(len(ids) for ids in samples)
        if longest + 1 > context:  # a capture request generates one token
            raise VLLMCaptureError(
                f"a sample of {longest} tokens does not fit {self.url}'s max_model_len "
                f"{context} (a capture request is the sample and one generated token): start "
                f"the server with --max-model-len {longest + 1} or more, or lower "
                f"hidden_states.max_seq_len to {context - 1} (the samples are cut at tokenize)"
            )

    def forward(
        self,
        samples: Sequence[Sequence[int]],
        images: Sequence[Sequence[Image]] | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The states of each sample; ``images``: each sample's images, in order (the
        samples hold their expanded image tokens)."""
        self._check_context(samples)
        pictures = images if images is not None else [()] * len(samples)
        states = self._loop.run_until_complete(self._capture_all(samples, pictures))
        out = []
        for rows in states:
            tokens = rows.shape[0]
            aux = rows[:, :3, :].reshape(tokens, 3 * self.hidden_size)
            last = rows[:, 3, :]
            if self._norm is not None:
                last = self._norm(last)
            out.append((aux.contiguous(), last.contiguous()))
        return out

    def close(self) -> None:
        if self._loop.is_closed():
            return
        if self._session is not None:
            self._loop.run_until_complete(self._session.close())
            self._session = None
        self._loop.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Print the ``vllm serve`` command of a capture server for a workflow config."""
    import argparse
    import sys

    from ..config import load_config

    parser = argparse.ArgumentParser(
        prog="python -m eagle3data.hidden_states.vllm_capture",
        description=(
            "Print the `vllm serve` command of the capture server the hidden_states jobs of "
            "CONFIG need (backend: vllm): the model, its aux layers and the pre-norm final "
            "state, vLLM's stock hidden-state connector writing to STORAGE; when CONFIG "
            "generates through a server (generation.backend: openai), also the reasoning and "
            "tool-call parsers the target's answers need, so that one server serves both "
            "stages. Arguments after -- are appended (parallel layout, --dtype, --port, ...)."
        ),
    )
    parser.add_argument("--config", type=Path, default=Path("config/config.yaml"))
    parser.add_argument(
        "--storage", required=True, help="folder vLLM writes into; the jobs must read it"
    )
    parser.add_argument("--model", help="the model path on the server (default: model.path)")
    parser.add_argument("extra", nargs="*", help="more vllm serve arguments (after --)")
    args = parser.parse_args(argv)
    config = load_config(args.config)
    hidden = config["hidden_states"]
    model_path = config["model"]["path"]
    config_json = model_config.read_model_config(model_path)
    depth = model_config.num_hidden_layers(config_json)
    aux = resolve_aux_layers(hidden["aux_layers"], depth, hidden["aux_layer_convention"])
    extra = list(args.extra)
    if config["model"]["trust_remote_code"] and "--trust-remote-code" not in extra:
        extra.append("--trust-remote-code")
    if config["generation"]["backend"] == "openai":
        # The generate stage may talk to this server (docs/how-to/vllm.md, "One server for
        # both stages"): without the parsers the reasoning and the tool calls stay raw text in
        # the content. They change nothing in what the capture requests get.
        flags = generation_flags(model_config.architectures(config_json))
        if flags is None:
            sys.stderr.write(
                f"note: no reasoning or tool-call parser is known here for "
                f"{model_config.architectures(config_json)}; a generation server of this "
                f"target needs its own (--reasoning-parser, --enable-auto-tool-choice "
                f"--tool-call-parser: vllm serve --help)\n"
            )
        elif not {"--reasoning-parser", "--tool-call-parser"} & set(extra):
            extra += flags
    command = serve_command(
        args.model or model_path,
        aux,
        str(args.storage),
        images=model_config.image_token_id(config_json) is not None,
        extra=extra,
    )
    sys.stdout.write(shlex.join(command) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
