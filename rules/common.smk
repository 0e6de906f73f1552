import json
import re
import sys
from pathlib import Path

from snakemake.logging import logger
from snakemake.utils import min_version, validate

# The workflow's logic lives in src/eagle3data; make it importable without an install.
sys.path.insert(0, str(Path(workflow.basedir) / "src"))

from eagle3data.driver_signals import relay_sigterm_off_main_thread
from eagle3data.settings import generation_settings

min_version("9.0")


validate(config, "../config/schema.yaml")

DATASETS = list(config["datasets"])
WORK_DIR = "results/.work"
DEMO_MODEL_DIR = "resources/models/SmolLM2-135M-Instruct"


def check_paths(config):
    """Name missing files at parse time, before any job starts."""
    problems = []
    model_dir = Path(config["model"]["path"])
    if model_dir != Path(DEMO_MODEL_DIR) and not (model_dir / "config.json").is_file():
        problems.append(f"model.path: {model_dir} is not a model directory (no config.json there)")
    for name, ds in config["datasets"].items():
        if not Path(ds["path"]).is_file():
            problems.append(f"datasets.{name}.path: {ds['path']} does not exist")
    if problems:
        raise ValueError("invalid config/config.yaml:\n  " + "\n  ".join(problems))


check_paths(config)


onstart:
    # Snakemake's own SIGTERM handler can deadlock the driver: see driver_signals.py.
    relay_sigterm_off_main_thread()


wildcard_constraints:
    dataset="|".join(re.escape(d) for d in DATASETS),
    shard=r"\d{5}",


def canonical(obj):
    """One stable string per value: key order in YAML must not trigger reruns."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def model_config_file():
    return f"{config['model']['path']}/config.json"


def dataset_config(wildcards):
    return config["datasets"][wildcards.dataset]


def dataset_source(wildcards):
    show_preview_on_dry_run()  # every target needs its prompts: the preview shows for all
    return dataset_config(wildcards)["path"]


def dataset_format(wildcards):
    return dataset_config(wildcards)["format"]


def dataset_on_invalid(wildcards):
    return dataset_config(wildcards)["on_invalid"]


def dataset_token_budget(wildcards):
    return dataset_config(wildcards)["token_budget"]


def dataset_max_samples(wildcards):
    return dataset_config(wildcards)["max_samples"]


def generation_params(wildcards):
    """Everything that changes generated content (budgets are separate params)."""
    return canonical(generation_settings(config))


def tokenize_params(wildcards):
    return canonical(
        {
            "chat_template_kwargs": config["model"]["chat_template_kwargs"],
            "max_seq_len": config["hidden_states"]["max_seq_len"],
        }
    )


# Where and on how many GPUs states are computed does not change them: leave those
# keys out, so adding them (or moving a run to another machine) re-runs nothing.
HIDDEN_STATE_EXECUTION_KEYS = ("gpus_per_job", "sglang")


def hidden_state_params(wildcards):
    hidden = {
        k: v for k, v in config["hidden_states"].items() if k not in HIDDEN_STATE_EXECUTION_KEYS
    }
    return canonical({"hidden_states": hidden, "dtype": config["model"]["dtype"]})


def shard_files(wildcards):
    plan_file = checkpoints.plan_shards.get(dataset=wildcards.dataset).output.plan
    with open(plan_file) as fh:
        plan = json.load(fh)
    return [
        f"results/hidden_states/{wildcards.dataset}/shard-{s['shard']:05d}.h5"
        for s in plan["shards"]
    ]


def final_targets():
    targets = [f"results/hidden_states/{ds}/manifest.json" for ds in DATASETS]
    targets += ["results/vocab/draft_vocab.pt", "results/vocab/draft_vocab.json"]
    targets += ["results/report/summary.html"]  # and the report's pictures (rules/report.smk)
    if config["export"]["specforge"]:
        targets += [f"results/specforge/{ds}" for ds in DATASETS]
    return targets


_PREVIEW_SHOWN = []


def show_preview_on_dry_run():
    """Print the hidden-state byte estimate once per dry run.

    Called from input functions: they run while the DAG is built, when
    workflow.dryrun is known (at parse time it is always False).
    """
    if workflow.dryrun and not _PREVIEW_SHOWN:
        _PREVIEW_SHOWN.append(True)
        from eagle3data.preview import preview_lines

        for line in preview_lines(config):
            logger.info(line)


def all_targets(wildcards):
    show_preview_on_dry_run()
    return final_targets()


def plan_shards_input(wildcards):
    show_preview_on_dry_run()
    return {
        "tokenized": f"results/tokenized/{wildcards.dataset}.parquet",
        "tokenize_stats": f"results/tokenized/{wildcards.dataset}.stats.json",
        "model": model_config_file(),
    }
