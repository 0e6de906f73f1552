"""The runbook (docs/runbook.md) and its complete configs (config/examples/) as a user runs
them, so that neither drifts from the code.

A copy of the workflow stands for the user's checkout: the demo's config/config.yaml as
shipped, the two example configs with ``model.path`` at a directory holding Kimi-K2.5's
``config.json`` (all a dry run reads of a checkpoint; the real sizes, so the dry run prints
the runbook's numbers) and small prompt files at the examples' own paths. Every
``snakemake`` command of the runbook runs there as a dry run (``-n`` added), what the runbook
says the first one prints is checked against what it prints, and the server commands, the
printed ``vllm serve`` line, the trainers' commands and configs and the disk arithmetic are
checked against the code that makes them.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from support.workflow import REPO, WORKFLOW_SOURCES, sharegpt_prompts, write_prompts

from eagle3data import layout
from eagle3data.config import PACKAGE_SCHEMA, check_config, validate_config
from eagle3data.consumers.speculators import train_command
from eagle3data.hidden_states.layers import resolve_aux_layers
from eagle3data.model_config import decoder_key_mapping, decoder_tensor_name
from eagle3data.shards import bytes_per_token

pytestmark = pytest.mark.e2e

RUNBOOK = REPO / "docs" / "runbook.md"
EXAMPLES = {
    "sglang": "config/examples/kimi-k2.5-sglang.yaml",
    "vllm": "config/examples/kimi-k2.5-vllm.yaml",
}
DATASETS = ["A1", *(f"B{i}" for i in range(1, 9))]
HIDDEN, LAYERS = 7168, 61
# Kimi-K2.5's config.json as far as a dry run, the checks and the serve command read it.
K25_CONFIG = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "media_placeholder_token_id": 163605,  # <|media_pad|>: an image-text target
    "text_config": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "vocab_size": 163840,
        "max_position_embeddings": 262144,
        "dtype": "bfloat16",
    },
}


# --- the runbook as text ----------------------------------------------------------------------


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, content)`` of every fenced block, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.M | re.S)


def runbook_commands() -> list[str]:
    """The commands of the runbook's bash blocks, continuation lines joined."""
    commands = []
    for language, body in fenced_blocks(RUNBOOK.read_text()):
        if language == "bash":
            commands += [c.strip() for c in body.replace("\\\n", " ").splitlines() if c.strip()]
    return commands


def runbook_text_block(first_line: str) -> str:
    [block] = [b for lang, b in fenced_blocks(RUNBOOK.read_text()) if b.startswith(first_line)]
    return block


def snakemake_commands() -> list[list[str]]:
    """Each distinct ``snakemake`` command of the runbook as the dry run the test runs."""
    seen: list[list[str]] = []
    for command in runbook_commands():
        args = shlex.split(command)
        if args[0] != ".venv/bin/snakemake":
            continue
        args = args[1:]
        if "--unlock" not in args and "-n" not in args:
            args.append("-n")
        if args not in seen:
            seen.append(args)
    return seen


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((REPO / EXAMPLES[name]).read_text())


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


# --- a user's checkout --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("box")
    model = base / "Kimi-K2.5"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(K25_CONFIG))
    root = base / "eagle3-data"
    for name in (*WORKFLOW_SOURCES, "config/config.yaml"):
        src, dst = REPO / name, root / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dst)
    for name, relative in EXAMPLES.items():
        text = (REPO / relative).read_text()
        checkpoint = example(name)["model"]["path"]
        assert text.count(f"path: {checkpoint}\n") == 1
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text.replace(f"path: {checkpoint}\n", f"path: {model}\n"))
    for dataset, entry in example("sglang")["datasets"].items():
        assert entry["path"] == f"prompts/{dataset}.jsonl"  # relative: the user's to replace
        (root / "prompts").mkdir(exist_ok=True)
        write_prompts(root / entry["path"], sharegpt_prompts(3))
    return root


def run(box: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(args, cwd=box, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (
        f"{shlex.join(args)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return proc


_SNAKEMAKE_RUNS: dict[tuple[str, ...], str] = {}


def snakemake(box: Path, args: list[str]) -> str:
    """What ``snakemake ARGS`` prints in ``box`` (each command run once per module)."""
    key = tuple(args)
    if key not in _SNAKEMAKE_RUNS:
        proc = run(box, [sys.executable, "-m", "snakemake", *args])
        _SNAKEMAKE_RUNS[key] = proc.stdout + proc.stderr
    return _SNAKEMAKE_RUNS[key]


# --- the configs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_example_passes_the_schema_and_every_check(name: str, box: Path) -> None:
    config = yaml.safe_load((box / EXAMPLES[name]).read_text())
    validate_config(config, PACKAGE_SCHEMA)
    check_config(config)  # the packages the exports import, the aux layers of the checkpoint
    assert list(config["datasets"]) == DATASETS
    for dataset in config["datasets"].values():
        assert dataset["token_budget"] == 10_000_000 and dataset["max_samples"] is None
    assert config["model"]["trust_remote_code"] is True
    assert config["model"]["chat_template_kwargs"] == {"thinking": True}
    assert config["generation"]["backend"] == "openai"
    assert config["hidden_states"]["backend"] == name
    assert config["export"]["specforge"] and config["export"]["speculators"]
    raw = (REPO / EXAMPLES[name]).read_text()
    assert raw.count("token_budget: 10M") == len(DATASETS)  # as people write it
    lines = raw.splitlines()
    for key in ("path: /models/Kimi-K2.5", "endpoints:", "api_key_env:", "storage_dtype:"):
        found = [i for i, text in enumerate(lines) if text.strip().startswith(key)]
        assert found, key
        for i in found:  # the comment above the key says EDIT
            assert any("EDIT" in text for text in lines[max(i - 4, 0) : i]), f"{name}: {key}"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_an_example_merged_over_the_demo_config_is_still_itself(name: str) -> None:
    """What Snakemake does without --replace-workflow-config: the example sets every key the
    demo's config/config.yaml sets, so nothing of the demo gets into the run."""
    from snakemake.utils import update_config

    merged = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    update_config(merged, example(name))
    assert merged == example(name)


# --- the runbook's commands -----------------------------------------------------------------------


def test_the_runbook_names_both_phases_for_both_examples() -> None:
    commands = snakemake_commands()
    for args in commands:
        assert "--replace-workflow-config" in args, shlex.join(args)
    sglang = [a for a in commands if option(a, "--configfile") == EXAMPLES["sglang"]]
    assert any("generation" in a for a in sglang)  # phase 1
    assert any("gpu=8" in a and "generation" not in a for a in sglang)  # phase 2
    assert any(option(a, "--configfile") == EXAMPLES["vllm"] for a in commands)


@pytest.mark.parametrize("args", snakemake_commands(), ids=shlex.join)
def test_each_snakemake_command_of_the_runbook_runs(args: list[str], box: Path) -> None:
    out = snakemake(box, args)
    assert "Config file config/config.yaml is replaced" in out  # nothing of the demo's
    if "--unlock" in args:
        return
    jobs = dict(re.findall(r"^(\w+)\s+(\d+)$", out, flags=re.M))
    assert jobs["prompts"] == jobs["generate"] == str(len(DATASETS)), out
    if "generation" in args:  # phase 1: the responses and nothing after them
        assert jobs["generation"] == "1" and "tokenize" not in jobs
    else:
        assert jobs["export_specforge"] == str(len(DATASETS)) and jobs["export_speculators"] == "1"
        assert re.search(r"^Next phase: generation of A1, B1, .*B8", out, flags=re.M), out


def test_the_first_dry_run_prints_what_the_runbook_says(box: Path) -> None:
    [args] = [a for a in snakemake_commands() if "--resources" in a and "-n" in a]
    out = snakemake(box, args).splitlines()
    shown = runbook_text_block("Config file config/config.yaml is replaced")
    for line in shown.splitlines():
        if "..." in line or "free on" in line:
            continue  # elided, or this machine's disk
        assert line in out, f"the runbook shows {line!r}; the dry run printed:\n" + "\n".join(out)
    # The runbook's bytes per token are the shard format's for Kimi-K2.5 in bf16.
    assert f"x {bytes_per_token(HIDDEN, 'bfloat16')} B" in shown


@pytest.mark.parametrize("command", [c for c in runbook_commands() if "eagle3data-status" in c])
def test_the_status_commands_of_the_runbook_run(command: str, box: Path) -> None:
    args = shlex.split(command)
    status = Path(sys.executable).parent / "eagle3data-status"
    proc = run(box, [str(status), *args[1:]])
    [row] = [line.split() for line in proc.stdout.splitlines() if line.startswith("B2 ")]
    assert "0/10000000" in row, proc.stdout  # the 10M budget, read as one integer


def test_the_sglang_server_is_the_one_the_sglang_example_talks_to() -> None:
    [command] = [c for c in runbook_commands() if "sglang.launch_server" in c]
    args = shlex.split(command)
    config = example("sglang")
    endpoint = urlsplit(config["generation"]["endpoints"][0])
    assert option(args, "--model-path") == config["model"]["path"]
    assert option(args, "--served-model-name") == config["generation"]["served_model"]
    assert option(args, "--host") == endpoint.hostname
    assert int(option(args, "--port")) == endpoint.port
    assert int(option(args, "--tp")) == config["hidden_states"]["sglang"]["tp_size"] == 8
    assert "--trust-remote-code" in args
    # What a Kimi-K2.5 generation server needs: the reasoning apart from the answer, tool
    # calls as tool_calls (SGLang 0.5.23's names; notes/kimi.md).
    assert option(args, "--reasoning-parser") == "kimi_k2"
    assert option(args, "--tool-call-parser") == "kimi_k2"


def test_the_printed_vllm_serve_command_is_the_runbooks(box: Path) -> None:
    [command] = [c for c in runbook_commands() if "eagle3data.hidden_states.vllm_capture" in c]
    args = shlex.split(command)
    assert args[0] == ".venv/bin/python"
    proc = run(box, [sys.executable, *args[1:]])
    config = example("vllm")
    model = yaml.safe_load((box / EXAMPLES["vllm"]).read_text())["model"]["path"]
    printed = proc.stdout.strip().replace(shlex.quote(model), config["model"]["path"])
    assert printed == runbook_text_block("vllm serve ").strip()
    served = shlex.split(printed)
    url = urlsplit(config["hidden_states"]["vllm"]["url"])
    assert config["generation"]["endpoints"] == [config["hidden_states"]["vllm"]["url"]]
    assert int(option(served, "--port")) == url.port
    assert option(served, "--served-model-name") == config["generation"]["served_model"]
    assert option(served, "--reasoning-parser") == option(served, "--tool-call-parser") == "kimi_k2"
    assert "--enable-auto-tool-choice" in served


def test_the_speculators_command_is_the_one_the_export_writes() -> None:
    config = validate_config(example("sglang"), PACKAGE_SCHEMA)
    hidden = config["hidden_states"]
    aux = resolve_aux_layers(hidden["aux_layers"], LAYERS, hidden["aux_layer_convention"])
    command = train_command(
        model_path=config["model"]["path"],
        data_path=layout.SPECULATORS,
        layer_ids=list(aux.hidden_states_indices),
        draft_vocab_size=config["draft_vocab"]["size"],
        dtype=config["export"]["dtype"],
        max_len=hidden["max_seq_len"],
    )
    assert shlex.join(command) == runbook_text_block("speculators train ").strip()


def test_the_specforge_config_reads_our_export_with_specforges_own_loader(
    tmp_path: Path,
) -> None:
    config = validate_config(example("sglang"), PACKAGE_SCHEMA)
    text = runbook_text_block("# kimi-k2.5-specforge.yaml")
    run_config = yaml.safe_load(text)
    assert run_config["data"]["hidden_states_path"] == layout.SPECFORGE.split("/{")[0]
    assert run_config["model"]["vocab_mapping_path"] == layout.DRAFT_VOCAB
    assert run_config["model"]["target_model_path"] == config["model"]["path"]
    assert run_config["data"]["max_length"] == config["hidden_states"]["max_seq_len"]
    # K2.5 keeps its decoder's tensors under language_model.: the names map onto the head
    # and embedding of the decoder the export's states came from.
    mapping = decoder_key_mapping(K25_CONFIG)
    assert decoder_tensor_name(run_config["model"]["lm_head_key"], mapping) == "lm_head.weight"
    embedding = decoder_tensor_name(run_config["model"]["embedding_key"], mapping)
    assert embedding == "model.embed_tokens.weight"
    specforge = pytest.importorskip("specforge.config", reason="README's test command installs it")
    path = tmp_path / "kimi-k2.5-specforge.yaml"
    path.write_text(text)
    loaded = specforge.load_config(str(path))
    assert loaded.mode == "offline" and loaded.deployment.trainer.nproc_per_node == 8


def test_the_disk_table_is_the_formats_arithmetic() -> None:
    text = RUNBOOK.read_text()
    bf16 = bytes_per_token(HIDDEN, "bfloat16")
    fp8 = bytes_per_token(HIDDEN, "bfloat16", "float8_e4m3fn")
    specforge = 4 * HIDDEN * 2 + 2 * 8  # hidden_state + aux_hidden_state bf16, two int64
    speculators = 4 * HIDDEN * 2 + 8 + 2 * 8  # [L, 4, H] bf16 + token_ids; the rows' two int64
    for value in (bf16, fp8, specforge, speculators):
        assert f"{value:,}" in text
    for tokens in (90e6, 108e6):
        for shards in (bf16, fp8):
            total = tokens * (shards + specforge + speculators) / 1e12
            assert f"{total:.2f} TB" in text, (tokens, shards)
    assert f"{90e6 * bf16 / 1e12:.2f} TB" in text and f"{90e6 * fp8 / 1e12:.2f} TB" in text
