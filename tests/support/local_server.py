"""The process plumbing that the real servers of the tests share (:class:`LocalServer`):
a server started as a child on a free port of 127.0.0.1, in its own session, with its
output in a log file, polled until ready, and stopped with its whole process group.

Subclasses (``support.llama_server.LlamaServer``, and through :class:`WorkerServer`
``support.sglang_server.SGLangServer`` and ``support.vllm_server.VLLMServer``) say what to
run (:meth:`LocalServer.command`, :meth:`LocalServer.env`), how to tell that it is ready
(:meth:`LocalServer._probe`), what their errors and messages are, and how to stop what it
started when SIGTERM-then-SIGKILL of the group is not enough.

:class:`WorkerServer` is the OpenAI-compatible server whose launcher spawns worker
processes (SGLang's scheduler and detokenizer, vLLM's engine core and worker): ready when
``GET /health`` answers 200 and ``/v1/models`` names the model, stopped only once no
process of its group is left, with its ``/metrics`` (Prometheus text) read by
:func:`parse_metrics`.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, ClassVar, Self, TypedDict

from eagle3data.servers.processes import shm_files


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def post_json(url: str, body: Any, *, timeout: float = 300.0) -> tuple[int, Any]:
    """POST JSON with urllib; returns (HTTP status, parsed JSON or raw text), 4xx/5xx too."""
    data = json.dumps(body).encode("utf-8")
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    text = raw.decode("utf-8", errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def server_flags(args: Mapping[str, Any]) -> list[str]:
    """Option fields as command-line flags: ``--name-with-dashes value``, True a bare
    switch, False and None left out."""
    flags: list[str] = []
    for name, value in args.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, str(value)]
    return flags


def parse_metric_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text as (name, labels, value) samples."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        pairs = (pair.split("=", 1) for pair in labels.rstrip("}").split(",") if "=" in pair)
        with contextlib.suppress(ValueError):
            samples.append((name, {k: v.strip('"') for k, v in pairs}, float(value)))
    return samples


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text: each metric's value summed over its label sets."""
    values: dict[str, float] = {}
    for name, _, value in parse_metric_samples(text):
        values[name] = values.get(name, 0.0) + value
    return values


def group_processes(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``, from /proc."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may hold spaces and parentheses.
        fields = text[text.rfind(")") + 2 :].split()
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            live.append(int(stat.parent.name))
    return live


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """``killpg`` that does not mind a group already gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


class ServerOptions(TypedDict, total=False):
    """The keyword options every :class:`LocalServer` takes (``**options`` of a subclass)."""

    extra_args: Sequence[str]  # appended to command()
    startup_timeout: float | None  # None: the class's default_startup_timeout
    stop_timeout: float | None  # None: the class's default_stop_timeout
    log_path: str | os.PathLike[str] | None  # None: a temp file
    python: str | None  # None: this interpreter


class LocalServerError(RuntimeError):
    """The server died or did not come up in time; the message ends with its log tail."""


class LocalServer:
    """A server process on 127.0.0.1 as a context manager; subclass it.

    :meth:`start` picks a free port, runs :meth:`command` with :meth:`env` in a new
    session (so the server leads its own process group) with stdout and stderr in
    ``log_path`` (a temp file unless given), and calls :meth:`_probe` every
    ``poll_interval`` seconds until it reports ready, the process exits, or
    ``startup_timeout`` passes. Leaving the block (or the interpreter) calls :meth:`stop`.
    A subclass's ``__init__`` takes its own keywords and passes ``**options``
    (:class:`ServerOptions`) on.
    """

    # Hooks of the subclass: its error class, the start of its temp log's name, how long
    # log_tail() is by default, how often _probe() runs, and the two failure messages
    # (str.format with code / timeout, last, url), each followed by the log tail.
    error: ClassVar[type[LocalServerError]] = LocalServerError
    log_prefix: ClassVar[str] = "local-server-"
    log_tail_chars: ClassVar[int] = 4000
    poll_interval: ClassVar[float] = 0.2
    exited_message: ClassVar[str] = "the server exited with code {code} before it was ready"
    not_ready_message: ClassVar[str] = (
        "the server was not ready within {timeout:g} s (last error: {last})"
    )
    # The defaults of startup_timeout and stop_timeout, which depend on the server.
    default_startup_timeout: ClassVar[float] = 120.0
    default_stop_timeout: ClassVar[float] = 10.0

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        extra_args: Sequence[str] = (),
        startup_timeout: float | None = None,
        stop_timeout: float | None = None,
        log_path: str | os.PathLike[str] | None = None,
        python: str | None = None,
    ) -> None:
        self.model = Path(model)
        self.extra_args = list(extra_args)
        self.startup_timeout = (
            self.default_startup_timeout if startup_timeout is None else startup_timeout
        )
        self.stop_timeout = self.default_stop_timeout if stop_timeout is None else stop_timeout
        self.python = python or sys.executable
        self.log_path = Path(log_path) if log_path is not None else None
        self.port: int | None = None
        self.model_name: str | None = None
        self.models_response: dict[str, Any] | None = None
        self.startup_s: float | None = None  # launch to ready
        self.stop_s: float | None = None  # the time stop() took to end the process
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    # -- what the subclass says --------------------------------------------------------

    def command(self) -> list[str]:
        """The server's command line; :attr:`port` is chosen when this is called."""
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        """The server's environment."""
        raise NotImplementedError

    def _check_model(self) -> None:
        """Raise FileNotFoundError before launching when :attr:`model` is not there."""

    def _probe(self) -> str | None:
        """One readiness check: None when ready, else why not (shown on a timeout). A
        connection error it raises means "not yet" as well."""
        raise NotImplementedError

    # -- addresses ---------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT`` (no ``/v1``)."""
        if self.port is None:
            raise self.error("the server is not started")
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The OpenAI base URL: ``http://127.0.0.1:PORT/v1``."""
        return f"{self.base_url}/v1"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _chosen_port(self) -> int:
        """:attr:`port` for :meth:`command`, which has no meaning before one is chosen."""
        if self.port is None:
            raise self.error("no port chosen yet")
        return self.port

    def log_tail(self, n_chars: int | None = None) -> str:
        """The end of the server's log (``log_tail_chars`` by default), for failure messages."""
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        n = self.log_tail_chars if n_chars is None else n_chars
        with open(self.log_path, "rb") as f:
            # Read only the end: a request log grows with every request.
            f.seek(max(0, f.seek(0, os.SEEK_END) - n))
            return f.read().decode("utf-8", errors="replace") or "(no log)"

    def log_text(self, offset: int = 0) -> str:
        """The server's log from byte ``offset`` on (see :meth:`log_offset`)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", errors="replace")

    def log_offset(self) -> int:
        """Where the log ends now: what :meth:`log_text` reads from, later."""
        return self.log_path.stat().st_size if self.log_path and self.log_path.exists() else 0

    # -- requests ----------------------------------------------------------------------

    def chat(self, body: Mapping[str, Any], *, timeout: float = 300.0) -> tuple[int, Any]:
        """POST /v1/chat/completions; (status, parsed body), errors too."""
        return post_json(f"{self.url}/chat/completions", dict(body), timeout=timeout)

    def get(self, path: str) -> tuple[int, Any]:
        """GET ``path`` (from the root, e.g. ``/v1/models``); (status, parsed JSON or text)."""
        try:
            with urllib.request.urlopen(f"{self.base_url}{path}", timeout=30) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code, exc.read().decode(errors="replace")

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> Self:
        if self._proc is not None:
            raise self.error("already started")
        self._check_model()
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=self.log_prefix, suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self.port = free_port()
        self._log_file = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        started = time.monotonic()
        self._proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=self.env(),
            # Its own session and process group: stop() signals the group, so whatever
            # the server spawns goes too, and a Ctrl-C at the terminal does not reach it.
            start_new_session=True,
        )
        # A server in its own session outlives this interpreter unless stopped.
        atexit.register(self.stop)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
        return self

    def _failure(self, message: str) -> LocalServerError:
        return self.error(f"{message}\n--- log tail ({self.log_path}) ---\n{self.log_tail()}")

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout
        last = ""
        while True:
            code = self._proc.poll()
            if code is not None:
                raise self._failure(self.exited_message.format(code=code, url=self.url))
            try:
                not_ready = self._probe()
                if not_ready is None:
                    return
                last = not_ready
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
                last = repr(exc)
            if time.monotonic() > deadline:
                message = self.not_ready_message.format(
                    timeout=self.startup_timeout, last=last, url=self.url
                )
                raise self._failure(message)
            time.sleep(self.poll_interval)

    def stop(self) -> None:
        """Terminate the whole process group: SIGTERM, then SIGKILL. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            atexit.unregister(self.stop)
            stopping = time.monotonic()
            # What the server's processes hold in /dev/shm: SGLang's server leaves its load
            # file and semaphores there (its workers die by SIGKILL, as the capture engine's,
            # which the product's reaper cleans up); a test run must not pile them up.
            held = shm_files(group_processes(proc.pid))
            self._stop_group(proc)
            self.stop_s = time.monotonic() - stopping
            deadline = time.monotonic() + 30
            while group_processes(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            for path in held:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def _stop_group(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGTERM the group, SIGKILL it after ``stop_timeout``; ``proc`` is reaped."""
        pgid = proc.pid  # start_new_session: the server leads its own group
        signal_group(pgid, signal.SIGTERM)
        try:
            proc.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            signal_group(pgid, signal.SIGKILL)
            proc.wait(timeout=self.stop_timeout)
        # Reap anything else left in the group (children the server spawned).
        signal_group(pgid, signal.SIGKILL)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class WorkerServer(LocalServer):
    """An OpenAI-compatible server whose launcher spawns workers (SGLang, vLLM).

    Ready when ``GET /health`` answers 200 (:attr:`model_name` and :attr:`models_response`
    then come from ``/v1/models``); :meth:`stop` sends SIGTERM to the whole group, SIGKILL
    to what is left after ``stop_timeout`` seconds, and waits until no process of the group
    is alive (the launcher gone is not the server gone: its workers are its children).
    Subclasses say :meth:`command` and :meth:`env`.
    """

    poll_interval = 1.0
    default_stop_timeout = 60.0

    def metrics_text(self) -> str:
        """``GET /metrics``: Prometheus text."""
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=30) as resp:
            return str(resp.read().decode())

    def metrics(self) -> dict[str, float]:
        """``/metrics``, each value summed over its labels (:func:`parse_metrics`). A counter
        may appear only once it has counted: read them with ``.get(name, 0.0)``."""
        return parse_metrics(self.metrics_text())

    def _check_model(self) -> None:
        if not (self.model / "config.json").is_file():
            raise FileNotFoundError(f"no model directory at {self.model}")

    def _probe(self) -> str | None:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=10) as resp:
                if resp.status != 200:
                    return f"HTTP {resp.status}"
        except urllib.error.HTTPError as exc:
            exc.close()
            return f"HTTP {exc.code}"  # SGLang: 503 while it warms up
        # /health says nothing of the model: its name comes from /v1/models.
        status, body = self.get("/v1/models")
        if status != 200 or not isinstance(body, dict):
            raise self.error(f"GET /v1/models -> {status}: {body!r}")
        self.models_response = body
        self.model_name = body["data"][0]["id"]
        return None

    def _stop_group(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGTERM the whole process group, SIGKILL what is left after ``stop_timeout``,
        and wait until none of its processes is alive."""
        pgid = proc.pid  # start_new_session: the launcher leads its own group
        signal_group(pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=self.stop_timeout)
        deadline = time.monotonic() + self.stop_timeout
        while (left := group_processes(pgid)) and time.monotonic() < deadline:
            time.sleep(0.5)
        if left:
            signal_group(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while (left := group_processes(pgid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        if left:
            raise self.error(f"server processes {left} outlived SIGKILL")
