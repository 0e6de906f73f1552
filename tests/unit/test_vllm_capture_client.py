"""The vllm capture backend's pieces that need no vLLM: the flags it asks the server for,
the serve command it prints, the connector files (read once whole, deleted after the
writer), and what it says, before any work, about a server that does not capture as the
config needs. The server side is real vLLM in ``tests/vllm/test_vllm_capture.py``; the
stand-in here answers only what real vLLM 0.32 was seen to answer (``tests/data/vllm/``:
``kv_transfer_params`` null without a connector; the connector's file layout)."""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from aiohttp import web
from safetensors.torch import save_file
from support.target_models import make_llama_dir

from eagle3data.errors import VLLMCaptureError
from eagle3data.hidden_states.layers import resolve_aux_layers
from eagle3data.hidden_states.vllm_capture import (
    TOKENS_ROUTE_FLAG,
    VLLMCapture,
    kv_transfer_config,
    layers_folder,
    main,
    request_prefix,
    serve_command,
    speculative_config,
    stated_layers,
    vllm_layer_ids,
)
from eagle3data.servers.vllm_files import discard_states, read_states

RECORDED = Path(__file__).resolve().parents[1] / "data" / "vllm"


def test_layer_ids_are_hidden_states_indices_then_the_pre_norm_final_state() -> None:
    aux = resolve_aux_layers("auto", 61, "layer_output")  # Kimi-K2.5's depth
    assert list(aux.layer_ids) == [1, 29, 57]
    assert vllm_layer_ids(aux) == [2, 30, 58, 61]
    spec = speculative_config(vllm_layer_ids(aux))
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [
        2,
        30,
        58,
        61,
    ]
    stock = kv_transfer_config("/data/hs")
    assert stock["kv_connector"] == "ExampleHiddenStatesConnector"
    assert stock["kv_connector_extra_config"] == {"shared_storage_path": "/data/hs"}
    assert "kv_connector_module_path" not in stock


def test_the_schema_fills_the_vllm_options_and_the_jobs_take_no_gpu() -> None:
    from eagle3data.config import PACKAGE_SCHEMA, validate_config
    from eagle3data.gpu_slots import job_gpus

    config = validate_config(
        {
            "model": {"path": "m"},
            "datasets": {"A": {"path": "x.jsonl"}},
            "hidden_states": {"backend": "vllm", "vllm": {"url": "http://h:8000/v1"}},
            "gpus": {"count": 8},
        },
        PACKAGE_SCHEMA,
    )
    assert config["hidden_states"]["vllm"] == {
        "url": "http://h:8000/v1",
        "model": None,
        "max_in_flight": 32,
        "request_timeout_s": 600,
        "max_retries": 3,
        "api_key_env": None,
    }
    assert job_gpus(config, "hidden_states") == 0  # the server owns the GPUs


def test_without_a_url_the_job_says_which_key_to_set(tmp_path: Path) -> None:
    model = make_llama_dir(tmp_path / "llama")
    with pytest.raises(VLLMCaptureError, match=r"hidden_states\.vllm\.url is not set"):
        VLLMCapture(str(model))


def test_request_ids_are_safe_and_name_the_job() -> None:
    prefix = request_prefix("my data/set-3")
    assert prefix.startswith("eagle3data-") and prefix.endswith("-my_data_set-3-")
    assert all(c.isalnum() or c in "_.-" for c in prefix)


@pytest.mark.parametrize(
    ("job", "other"),
    [("A-1-0", "A-1-0-5"), ("A/1-0", "A_1-0"), ("A1-1", "A1-10"), ("x-2", "x-2-probe")],
)
def test_no_jobs_request_ids_start_like_anothers(job: str, other: str) -> None:
    """A job deletes the files whose names start with its prefix (a killed attempt's): the
    shard 0 of dataset A-1 must not take dataset A-1-0's, nor two names that sanitise
    alike each other's."""
    a, b = request_prefix(job), request_prefix(other)
    assert not a.startswith(b) and not b.startswith(a)


def test_the_serve_command_comes_from_the_config(tmp_path: Path, capsys: Any) -> None:
    model = make_llama_dir(tmp_path / "llama")
    config = {
        "model": {"path": str(model), "trust_remote_code": True},
        "datasets": {"A": {"path": "x.jsonl"}},
        "hidden_states": {
            "backend": "vllm",
            "aux_layers": [2, 3, 5],
            "vllm": {"url": "http://h:8000/v1"},
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["--config", str(path), "--storage", "/data/hs", "--", "-tp", "8"]) == 0
    args = shlex.split(capsys.readouterr().out)
    assert args[:3] == ["vllm", "serve", str(model)]
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [
        3,
        4,
        6,
        8,
    ]
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    # The folder states the layers: the capture reads them back from the files' paths.
    folder = kv["kv_connector_extra_config"]["shared_storage_path"]
    assert folder == "/data/hs/eagle3data-layers-3-4-6-8"
    assert stated_layers(Path(folder)) == [3, 4, 6, 8]
    assert args[-3:] == ["-tp", "8", "--trust-remote-code"]


def test_an_image_targets_serve_command_opens_the_token_route(tmp_path: Path) -> None:
    from support.vlm_models import make_qwen2_vl_dir

    model = make_qwen2_vl_dir(tmp_path / "qwen2.5-vl", qwen2_5=True)
    aux = resolve_aux_layers([0, 1, 2], 4, "layer_output")
    assert TOKENS_ROUTE_FLAG in serve_command(str(model), aux, "/hs", images=True)
    assert TOKENS_ROUTE_FLAG not in serve_command(str(model), aux, "/hs")
    once = serve_command(str(model), aux, "/hs", images=True, extra=[TOKENS_ROUTE_FLAG])
    assert once.count(TOKENS_ROUTE_FLAG) == 1


# --- the connector's files ------------------------------------------------------------------


def write_like_the_connector(path: Path, states: torch.Tensor, ids: list[int]) -> None:
    save_file({"hidden_states": states, "token_ids": torch.tensor(ids)}, str(path))


def test_a_file_is_read_only_once_the_writer_lets_go(tmp_path: Path) -> None:
    path = tmp_path / "cmpl-x-0-abc.safetensors"
    lock = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)  # as vLLM's worker holds it before answering
    states = torch.randn(5, 4, 8)

    def writer() -> None:
        time.sleep(0.3)
        write_like_the_connector(path, states, [1, 2, 3, 4, 5])
        os.close(lock)

    thread = threading.Thread(target=writer)
    thread.start()
    started = time.monotonic()
    got = read_states(str(path))
    assert time.monotonic() - started >= 0.25
    thread.join()
    assert torch.equal(got["hidden_states"], states)
    discard_states(str(path))
    assert list(tmp_path.iterdir()) == []


def test_discarding_a_file_being_written_waits_for_the_writer(tmp_path: Path) -> None:
    path = tmp_path / "cmpl-y-0-abc.safetensors"
    lock = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)

    def writer() -> None:
        time.sleep(0.2)
        write_like_the_connector(path, torch.zeros(2, 4, 8), [1, 2])
        os.close(lock)

    thread = threading.Thread(target=writer)
    thread.start()
    discard_states(str(path))  # before the file exists: deleting then would leave it behind
    thread.join()
    assert list(tmp_path.iterdir()) == []


# --- a stand-in server ------------------------------------------------------------------------


class StandIn:
    """``/v1/models`` and ``/v1/completions`` as vLLM answers them, writing the connector's
    file with ``shape``/``dtype`` (``None``: no connector, ``kv_transfer_params`` null)."""

    def __init__(
        self,
        storage: Path | None,
        shape: tuple[int, int],
        dtype: torch.dtype,
        *,
        elsewhere: bool = False,
        models_text: str | None = None,
    ) -> None:
        self.storage, self.shape, self.dtype = storage, shape, dtype
        self.elsewhere = elsewhere  # the file is not where this job can read it
        self.models_text = models_text  # /v1/models answers this instead of vLLM's list
        self.completions_received = 0

    async def models(self, request: web.Request) -> web.Response:
        if self.models_text is not None:
            return web.Response(text=self.models_text)
        recorded = json.loads((RECORDED / "models.json").read_text())
        return web.json_response(recorded["response"])

    async def completions(self, request: web.Request) -> web.Response:
        self.completions_received += 1
        body = await request.json()
        ids = body["prompt"]
        params = None
        if self.storage is not None:
            path = self.storage / f"cmpl-{body['request_id']}-0-1234abcd.safetensors"
            layers, width = self.shape
            write_like_the_connector(
                path, torch.zeros(len(ids), layers, width, dtype=self.dtype), ids
            )
            if self.elsewhere:
                path.unlink()
            params = {"hidden_states_path": str(path)}
        return web.json_response(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "choices": [],
                "kv_transfer_params": params,
            }
        )


@pytest.fixture
def stand_in() -> Iterator[Any]:
    servers: list[Any] = []

    def start(server: StandIn) -> str:
        import asyncio

        loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_get("/v1/models", server.models)
        app.router.add_post("/v1/completions", server.completions)
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        servers.append((loop, runner, thread))
        return f"http://127.0.0.1:{port}/v1"

    yield start
    for loop, runner, thread in servers:
        import asyncio

        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()


def capture_error(model: Path, url: str, **kw: Any) -> str:
    with pytest.raises(VLLMCaptureError) as caught:
        VLLMCapture(str(model), dtype="float32", options={"url": url}, **kw)
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.fixture
def llama(tmp_path: Path) -> Path:
    return make_llama_dir(tmp_path / "llama")  # 8 layers, width 64


@pytest.fixture
def storage(tmp_path: Path) -> Path:
    """The stand-in server's shared_storage_path, named after the layers it captures as
    the printed command names it (the tiny Llama's 8 layers, aux layers auto)."""
    folder = tmp_path / layers_folder(vllm_layer_ids(resolve_aux_layers("auto", 8, "layer_output")))
    folder.mkdir()
    return folder


def test_a_server_without_the_connector_is_refused_with_the_command(
    llama: Path, stand_in: Any
) -> None:
    message = capture_error(llama, stand_in(StandIn(None, (4, 64), torch.float32)))
    assert "does not extract hidden states" in message
    assert "vllm serve" in message and '"eagle_aux_hidden_state_layer_ids": [2, 4, 5, 8]' in message


def test_a_server_capturing_other_layers_or_widths_is_refused(
    llama: Path, storage: Path, stand_in: Any
) -> None:
    fewer = capture_error(llama, stand_in(StandIn(storage, (3, 64), torch.float32)))
    assert "3 layers, not the 4 ([2, 4, 5, 8])" in fewer
    wider = capture_error(llama, stand_in(StandIn(storage, (4, 128), torch.float32)))
    assert "width 128, not the target's hidden size 64" in wider
    assert list(storage.iterdir()) == []  # the probe's files are gone


def test_files_this_job_cannot_read_are_named(llama: Path, storage: Path, stand_in: Any) -> None:
    message = capture_error(
        llama, stand_in(StandIn(storage, (4, 64), torch.float32, elsewhere=True))
    )
    assert "which this job cannot read" in message and "shared_storage_path" in message


def test_a_killed_attempts_files_are_deleted_when_its_shard_begins(
    llama: Path, storage: Path, stand_in: Any
) -> None:
    """A capture engine's client outlives its shards: the files of a killed attempt at a
    shard are found by the shard's name, whatever client sent them."""
    prefix = request_prefix("A1-0")
    stale = storage / f"cmpl-{prefix}7-0-deadbeef.safetensors"
    write_like_the_connector(stale, torch.zeros(3, 4, 64), [1, 2, 3])
    # An image sample's, from the token route: vLLM names those "generate-tokens-{id}".
    stale_image = storage / f"generate-tokens-{prefix}8-deadbeef.safetensors"
    write_like_the_connector(stale_image, torch.zeros(3, 4, 64), [1, 2, 3])
    # Dataset A1-0's shard 5: its ids once started with A1's shard 0's.
    other = storage / f"cmpl-{request_prefix('A1-0-5')}7-0-deadbeef.safetensors"
    write_like_the_connector(other, torch.zeros(3, 4, 64), [1, 2, 3])
    url = stand_in(StandIn(storage, (4, 64), torch.float32))
    capture = VLLMCapture(str(llama), dtype="float32", options={"url": url}, job="engine-1a2b3c")
    try:
        assert stale.exists() and stale_image.exists()  # kept until their shard begins
        capture.begin_shard("A1-0")
        assert sorted(p.name for p in storage.iterdir()) == [other.name]  # another job's kept
        states = capture.forward([[5, 6, 7], [8, 9]])
        assert [(a.shape, last.shape) for a, last in states] == [
            (torch.Size([3, 192]), torch.Size([3, 64])),
            (torch.Size([2, 192]), torch.Size([2, 64])),
        ]
    finally:
        capture.close()
    assert sorted(p.name for p in storage.iterdir()) == [other.name]


def test_a_server_that_is_not_up_is_named_with_the_command(llama: Path) -> None:
    from support.local_server import free_port

    message = capture_error(llama, f"http://127.0.0.1:{free_port()}/v1")
    assert "is the capture server up?" in message and "vllm serve" in message


@pytest.mark.parametrize("answer", ["OK", "[]", '{"models": []}'])
def test_a_models_answer_that_is_not_a_model_list_is_refused_in_one_line(
    llama: Path, stand_in: Any, answer: str
) -> None:
    """A URL that is not the OpenAI base (a proxy's health page, the server's root)."""
    url = stand_in(StandIn(None, (4, 64), torch.float32, models_text=answer))
    message = capture_error(llama, url)
    assert "is not a model list" in message and "ending in /v1" in message


def test_samples_longer_than_the_servers_context_are_refused_before_any_request(
    llama: Path, storage: Path, stand_in: Any
) -> None:
    """The recorded server's max_model_len is 1024: a sample of 1024 tokens (and its one
    generated token) cannot fit, and would fail the same on every retry of the shard."""
    server = StandIn(storage, (4, 64), torch.float32)
    capture = VLLMCapture(str(llama), dtype="float32", options={"url": stand_in(server)})
    try:
        probed = server.completions_received
        with pytest.raises(VLLMCaptureError) as caught:
            capture.forward([[5, 6, 7], [1] * 1024])
        assert server.completions_received == probed  # nothing sent for the shard
        message = str(caught.value)
        assert "1024 tokens does not fit" in message and "--max-model-len 1025" in message
        assert "hidden_states.max_seq_len to 1023" in message
        assert len(capture.forward([[1] * 1023])[0][0]) == 1023  # what fits is captured
    finally:
        capture.close()


def test_every_answer_is_checked_not_only_the_probe(
    llama: Path, storage: Path, tmp_path: Path, stand_in: Any
) -> None:
    """A capture engine keeps its client for the whole run: a server restarted in the
    meantime with other layers, or another target's width, is refused at its first answer."""
    server = StandIn(storage, (4, 64), torch.float32)
    capture = VLLMCapture(str(llama), dtype="float32", options={"url": stand_in(server)})
    try:
        capture.begin_shard("A1-0")
        assert len(capture.forward([[5, 6, 7]])) == 1
        server.storage = tmp_path / "eagle3data-layers-3-4-6-8"
        server.storage.mkdir()
        with pytest.raises(VLLMCaptureError, match=r"states layers \[3, 4, 6, 8\]"):
            capture.forward([[5, 6, 7]])
        server.storage, server.shape = storage, (4, 128)
        with pytest.raises(VLLMCaptureError, match="width 128, not the target's hidden size 64"):
            capture.forward([[5, 6, 7]])
    finally:
        capture.close()


@pytest.mark.parametrize("folder", ["eagle3data-layers-3-4-6-8", "hs"])
def test_a_server_whose_storage_states_other_layers_or_none_is_refused(
    llama: Path, tmp_path: Path, stand_in: Any, folder: str
) -> None:
    """vLLM says its capture layers nowhere but in the storage folder our command names
    after them: a server started with other layers (or named otherwise, by hand) returns
    four layers of the right width and would fill shards labelled with ours."""
    storage = tmp_path / folder
    storage.mkdir()
    message = capture_error(llama, stand_in(StandIn(storage, (4, 64), torch.float32)))
    said = "states layers [3, 4, 6, 8]" if folder != "hs" else "does not state the layers"
    assert said in message and "this config captures layers [2, 4, 5, 8]" in message
    assert "eagle3data-layers-2-4-5-8" in message  # the command to start it with
    assert list(storage.iterdir()) == []  # the probe's file deleted, nothing captured


def test_image_samples_need_the_token_route_and_one_run_of_tokens_per_image(
    tmp_path: Path, stand_in: Any
) -> None:
    """An image sample goes to vLLM's token route: a server without it (404 here, 403 from
    vLLM without the flag) is named with the flag; images whose tokens touch are refused
    before any request (their placeholders could not be told apart)."""
    from PIL import Image
    from support.vlm_models import make_qwen2_vl_dir

    model = make_qwen2_vl_dir(tmp_path / "qwen2.5-vl", qwen2_5=True)  # 4 layers, width 64
    image = json.loads((model / "config.json").read_text())["image_token_id"]
    aux = [0, 1, 2]
    storage = tmp_path / layers_folder(vllm_layer_ids(resolve_aux_layers(aux, 4, "layer_output")))
    storage.mkdir()
    url = stand_in(StandIn(storage, (4, 64), torch.float32))
    capture = VLLMCapture(str(model), aux_layers=aux, dtype="float32", options={"url": url})
    picture = Image.new("RGB", (56, 56))
    try:
        with pytest.raises(VLLMCaptureError) as caught:
            capture.forward([[1, image, image, 2]], images=[[picture]])
        assert "/inference/v1/generate" in str(caught.value) and "-> HTTP 404" in str(caught.value)
        assert f"start it with {TOKENS_ROUTE_FLAG}" in str(caught.value)
        with pytest.raises(VLLMCaptureError, match="2 images holds 1 runs of image tokens"):
            capture.forward([[1, image, image, 2]], images=[[picture, picture]])
        # A text sample of the same target still goes to /v1/completions.
        ((aux, last),) = capture.forward([[1, 2, 3]], images=[[]])
        assert aux.shape == (3, 192) and last.shape == (3, 64)
    finally:
        capture.close()
