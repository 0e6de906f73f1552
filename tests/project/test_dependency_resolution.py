"""The dependency declarations hold together: pyproject.toml's ranges admit what each lock in
constraints/ pins, no lock names a package twice, and each install the docs name (an extra,
or extras together: the GPU box that drives SLURM needs ``.[gpu,slurm]``) still resolves on the
package index, with the lock the docs install it with, to the lock's versions (pip's own
resolver in a dry run: nothing is installed).

The resolutions need the index: they skip, saying why, when it cannot be reached (deselect them
with ``-m "not network"``). They run side by side in a throwaway venv with a newer pip: the
pip 23.2.1 that Python 3.11's venv bundles took 82 s + 58 s + 32 s (gpu, test, slurm, one after
the other, 2-core machine), pip 26.3 35 s + 23 s + 17 s; the whole module takes about 1 min,
1.5 min with the gpu,slurm pair (four side by side on a shared 2-core machine: 56 s each for
gpu and gpu,slurm, about 30 s for test and slurm), without this machine's local wheel indexes
too (fast-deps: no GBs of CUDA wheels downloaded).
Both pips resolve to the same versions: the locks pin every package. In a session on one
worker they start in the background when collection ends (the 2.5 to 3 min they took in
the CI run overlap the tests that run before this module; ``BackgroundResolutions``);
under pytest-xdist, when the worker that runs this module reaches it.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from support.workflow import REPO

LOCKS = {"cpu": REPO / "constraints" / "cpu.txt", "gpu": REPO / "constraints" / "gpu.txt"}
# The lock each install (its extras, as pip spells them in `.[...]`) is made with
# (docs/how-to/install.md): the
# CPU default's extras, the GPU box, and the GPU box that drives SLURM (sglang's numpy < 2.4
# rules out the slurm plugin's newest releases there).
EXTRA_LOCK = {"test": "cpu", "slurm": "cpu", "gpu": "gpu", "gpu,slurm": "gpu"}
# The pip the resolutions run (see the docstring); the interpreter's own when it cannot be had.
PIP = "pip==26.3"
# pip's words for an index it could not reach (it retries, then says it found nothing).
NETWORK_TROUBLE = re.compile(
    r"Retrying \(Retry\(|Could not fetch URL|NewConnectionError|NameResolutionError|"
    r"ConnectTimeout|Read timed out|ProxyError|SSLError|Connection (refused|reset)"
)
OWN_NAME = canonicalize_name("eagle3-data")
QUICK = ["--retries", "1", "--timeout", "10", "--disable-pip-version-check"]


def read_lock(path: Path) -> list[tuple[str, str]]:
    """(canonical name, version) of each ``name==version`` line, in order."""
    pins = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==" and not req.marker, (
            f"{path.name}:{number}: {line!r} is not an exact pin (name==version)"
        )
        pins.append((canonicalize_name(req.name), specs[0].version))
    return pins


def lock_pins(lock: str) -> dict[str, str]:
    return dict(read_lock(LOCKS[lock]))


def requirements(*extras: str) -> list[Requirement]:
    """pyproject.toml's dependencies and those of the given extras."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in extras:
        lines += project["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


def all_extras() -> list[str]:
    return list(
        tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )


def install_extras(install: str) -> list[str]:
    """The extras of one install of ``EXTRA_LOCK`` (``"gpu,slurm"``: gpu and slurm)."""
    return install.split(",")


def lock_extras(lock: str) -> list[str]:
    return sorted(
        {
            extra
            for install, name in EXTRA_LOCK.items()
            if name == lock
            for extra in install_extras(install)
        }
    )


def full_install(lock: str) -> str:
    """The install of ``lock`` with every extra it is made with: the lock is its resolution."""
    return max(
        (i for i, name in EXTRA_LOCK.items() if name == lock), key=lambda i: len(install_extras(i))
    )


# --- The declarations, no index needed -----------------------------------------------------------


def test_every_extra_has_a_lock() -> None:
    installed = {extra for install in EXTRA_LOCK for extra in install_extras(install)}
    assert sorted(all_extras()) == sorted(installed)


@pytest.mark.parametrize("lock", sorted(LOCKS))
def test_a_lock_names_each_package_once(lock: str) -> None:
    names = [name for name, _ in read_lock(LOCKS[lock])]
    twice = sorted({name for name in names if names.count(name) > 1})
    assert twice == [], f"{LOCKS[lock].name} pins these more than once"


@pytest.mark.parametrize("lock", sorted(LOCKS))
def test_the_lock_pins_every_requirement_of_its_extras(lock: str) -> None:
    pins = lock_pins(lock)
    unpinned = [
        str(r) for r in requirements(*lock_extras(lock)) if canonicalize_name(r.name) not in pins
    ]
    assert unpinned == [], f"{LOCKS[lock].name} pins no version of these requirements"


@pytest.mark.parametrize("lock", sorted(LOCKS))
def test_every_range_admits_what_the_lock_pins(lock: str) -> None:
    # Every extra's ranges, not only the lock's own: the gpu lock's pins of packages the test
    # extra names must fit too (one venv may hold both).
    pins = lock_pins(lock)
    refused = [
        f"{req} (lock: {pins[canonicalize_name(req.name)]})"
        for req in requirements(*all_extras())
        if canonicalize_name(req.name) in pins
        and not req.specifier.contains(Version(pins[canonicalize_name(req.name)]), prereleases=True)
    ]
    assert refused == [], f"pyproject.toml's ranges refuse what {LOCKS[lock].name} pins"


# --- The resolutions, on the package index ------------------------------------------------------


@dataclass
class Resolution:
    extra: str
    lock: str
    returncode: int
    output: str
    seconds: float
    resolved: dict[str, str]  # canonical name -> version, this package left out


def network_trouble(output: str) -> str | None:
    """The first line of pip's output that says the index could not be reached."""
    return next((line for line in output.splitlines() if NETWORK_TROUBLE.search(line)), None)


def skip_unless_lock_platform() -> None:
    here = (sys.platform, platform.machine(), platform.python_implementation(), sys.version_info)
    if here[:3] != ("linux", "x86_64", "CPython") or here[3][:2] != (3, 11):
        pytest.skip(
            f"the locks are resolutions for Linux x86_64, CPython 3.11 (their headers); "
            f"this is {here[0]} {here[1]}, {here[2]} {platform.python_version()}"
        )


def probe_index() -> None:
    """Skip when pip cannot reach the index that serves sglang (a package no local index here
    holds); a quick question with pip's own settings (proxy, certificates, index URLs)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "sglang", *QUICK],
        capture_output=True,
        text=True,
        timeout=120,
    )
    trouble = network_trouble(proc.stdout + proc.stderr)
    if proc.returncode != 0 and trouble:
        pytest.skip(f"the package index cannot be reached: {trouble.strip()}")


def fast_pip(root: Path) -> list[str]:
    """A throwaway venv's pip, upgraded to ``PIP``; its bundled pip when that fails."""
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=300)
    python = str(root / "bin" / "python")
    upgrade = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", PIP],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if upgrade.returncode != 0:
        print(f"{PIP} not installed, resolving with the bundled pip:\n{upgrade.stderr[-2000:]}")
    return [python, "-m", "pip"]


def resolve(pip: list[str], extra: str, report: Path) -> Resolution:
    lock = EXTRA_LOCK[extra]
    start = time.monotonic()
    command = [
        *pip,
        "install",
        "--dry-run",
        "--ignore-installed",
        "--quiet",
        "--report",
        str(report),
        "-e",
        f".[{extra}]",
        "-c",
        str(LOCKS[lock]),
        "--disable-pip-version-check",
        # Reads a wheel's metadata with HTTP range requests, where the index serves none
        # (pip downloads the whole wheel when the server cannot): not the GBs of CUDA wheels.
        "--use-feature=fast-deps",
    ]
    proc = subprocess.run(
        command,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PIP_NO_INPUT": "1"},
    )
    resolved = {}
    if proc.returncode == 0:
        for item in json.loads(report.read_text())["install"]:
            name = canonicalize_name(item["metadata"]["name"])
            if name != OWN_NAME:
                resolved[name] = Version(item["metadata"]["version"]).public  # 2.13.0+cpu too
    seconds = time.monotonic() - start
    return Resolution(extra, lock, proc.returncode, proc.stdout + proc.stderr, seconds, resolved)


def resolve_all(wanted: list[str], root: Path) -> dict[str, Resolution] | str:
    """The dry run of each extra in ``wanted``, side by side; a reason to skip instead when
    this is not the locks' platform or the index cannot be reached."""
    try:
        skip_unless_lock_platform()
        probe_index()
    except pytest.skip.Exception as skip:
        return str(skip.msg)
    pip = fast_pip(root / "venv")
    with ThreadPoolExecutor(max_workers=len(wanted)) as pool:
        futures = {e: pool.submit(resolve, pip, e, root / f"{e}.json") for e in wanted}
        return {extra: future.result() for extra, future in futures.items()}


class BackgroundResolutions:
    """The resolutions wait on the index most of their ~3 min, so they start in a thread
    when the session's collection ends (``tests/conftest.py``: ``pytest_collection_finish``)
    and the tests before this module run meanwhile; the fixture collects them."""

    def __init__(self) -> None:
        self.future: Future[dict[str, Resolution] | str] | None = None
        self.root: tempfile.TemporaryDirectory[str] | None = None

    def start(self, items: list[pytest.Item]) -> None:
        wanted = sorted(
            {
                item.callspec.params["extra"]
                for item in items
                if getattr(item, "originalname", None) == "test_the_extra_resolves_to_its_lock"
            }
        )
        if not wanted or self.future is not None:
            return
        self.root = tempfile.TemporaryDirectory(prefix="eagle3data-resolution-")
        self.future = Future()
        future, root = self.future, Path(self.root.name)

        def run() -> None:
            try:
                future.set_result(resolve_all(wanted, root))
            except BaseException as error:  # the fixture raises it in the test
                future.set_exception(error)

        # A daemon: an interrupted session does not wait for pip.
        threading.Thread(target=run, name="dependency-resolutions", daemon=True).start()


BACKGROUND = BackgroundResolutions()


@pytest.fixture(scope="module")
def resolutions(request: pytest.FixtureRequest) -> Iterator[dict[str, Resolution]]:
    """The dry run of each selected extra, started when the collection ended."""
    BACKGROUND.start(request.session.items)  # already started in a whole session
    assert BACKGROUND.future is not None and BACKGROUND.root is not None
    try:
        done = BACKGROUND.future.result()
        if isinstance(done, str):
            pytest.skip(done)
        for r in done.values():
            print(f"dry run of .[{r.extra}] -c {LOCKS[r.lock].name}: {r.seconds:.0f} s")
        yield done
    finally:
        BACKGROUND.root.cleanup()


@pytest.mark.network
@pytest.mark.parametrize("extra", sorted(EXTRA_LOCK))
def test_the_extra_resolves_to_its_lock(resolutions: dict[str, Resolution], extra: str) -> None:
    r = resolutions[extra]
    if r.returncode != 0:
        trouble = network_trouble(r.output)
        if trouble:
            pytest.skip(f"the package index could not be reached midway: {trouble.strip()}")
    assert r.returncode == 0, (
        f"pip install --dry-run -e '.[{extra}]' -c {LOCKS[r.lock].name} failed:\n{r.output[-6000:]}"
    )
    pins = lock_pins(r.lock)
    # What matters: every requirement pyproject.toml states for this extra gets the lock's
    # version (sglang 0.5.23, torch 2.14.1 and transformers 5.19.0 on the GPU box).
    wrong = {
        req.name: (
            r.resolved.get(canonicalize_name(req.name)),
            pins.get(canonicalize_name(req.name)),
        )
        for req in requirements(*install_extras(extra))
        if r.resolved.get(canonicalize_name(req.name)) != pins.get(canonicalize_name(req.name))
    }
    assert wrong == {}, f"resolved version != {LOCKS[r.lock].name}'s (name: (resolved, lock))"
    if r.lock == "gpu":
        # The gpu lock is the resolution of its fullest install (.[gpu,slurm]): nothing
        # missing from it, and nothing stale in it; a smaller install takes a part of it.
        # (The cpu lock is a venv's freeze: setuptools is not in it, and without the local
        # CPU torch wheel pip resolves torch's CUDA build and its nvidia-* packages.)
        assert sorted(set(r.resolved) - set(pins)) == [], "resolved, but not in gpu.txt"
        if extra == full_install(r.lock):
            assert sorted(set(pins) - set(r.resolved)) == [], "in gpu.txt, but not resolved"
