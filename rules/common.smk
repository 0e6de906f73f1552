import json
import re
import sys
from pathlib import Path

from snakemake.logging import logger
from snakemake.settings.types import DeploymentMethod
from snakemake.utils import min_version, validate

# The workflow's logic lives in src/eagle3data; make it importable without an install.
sys.path.insert(0, str(Path(workflow.basedir) / "src"))

from eagle3data import layout
from eagle3data.config import canonical_json, check_config
from eagle3data.driver_signals import relay_sigterm_off_main_thread
from eagle3data.hidden_states.capture_service import mark_run_owner, stop_engines
from eagle3data.generation.settings import generation_settings
from eagle3data.gpu_slots import job_gpus
from eagle3data.errors import ConfigError, PromptFormatError
from eagle3data.hidden_states.settings import hidden_state_settings
from eagle3data.hidden_states.phases import capture_waits_for_all, next_phase_line
from eagle3data.prompts.source_files import source_files
from eagle3data.tokenization.settings import tokenize_settings

min_version("9.0")


validate(config, "../config/schema.yaml")
# Keys that cannot go together, and packages what the config enables needs: refused now,
# not when their job runs after days of generation; in one line (raised, Snakemake would
# add its own traceback of this file).
# With conda environments the exports' and draft check's jobs import from theirs
# (envs/torch.yaml), not from this process's.
deploys_conda = DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method
try:
    check_config(
        config,
        rule_env=Path(workflow.basedir) / "envs" / "torch.yaml" if deploys_conda else None,
    )
except ConfigError as problem:
    print(problem, file=sys.stderr)
    raise SystemExit(1)

DATASETS = list(config["datasets"])


def check_paths(config):
    """Name missing files at parse time, before any job starts."""
    problems = []
    model_dir = Path(config["model"]["path"])
    if model_dir != Path(layout.DEMO_MODEL) and not (model_dir / "config.json").is_file():
        problems.append(f"model.path: {model_dir} is not a model directory (no config.json there)")
    for name, ds in config["datasets"].items():
        try:
            source_files(ds["path"], split=ds.get("split"))
        except PromptFormatError as exc:
            problems.append(f"datasets.{name}.path: {exc}")
    if problems:
        # One message, no traceback of this file (as check_config above).
        print("invalid config:\n  " + "\n  ".join(problems), file=sys.stderr)
        raise SystemExit(1)


check_paths(config)


# This process is the run: capture engines it starts (one load of the target for all
# its shard jobs, capture_service.py) stop when it ends, however it ends.
mark_run_owner()


onstart:
    # Snakemake's own SIGTERM handler can deadlock the driver: see driver_signals.py.
    relay_sigterm_off_main_thread()


onsuccess:
    stop_engines()


onerror:
    stop_engines()


wildcard_constraints:
    dataset="|".join(re.escape(d) for d in DATASETS),
    shard=r"\d{5}",


# What changes each stage's output, spelled canonically (reordered YAML re-runs
# nothing): the rules' params, hence their rerun triggers, and what their scripts read.
GENERATION_SETTINGS = canonical_json(generation_settings(config))
TOKENIZE_SETTINGS = canonical_json(tokenize_settings(config))
HIDDEN_STATE_SETTINGS = canonical_json(hidden_state_settings(config))


def model_config_file():
    """The model's config.json: an input of every job that loads the model (its
    directory is the model path the scripts use)."""
    return f"{config['model']['path']}/config.json"


def dataset_source(wildcards):
    show_preview_on_dry_run()  # every target needs its prompts: the preview shows for all
    dataset = config["datasets"][wildcards.dataset]
    # Every file of a folder or glob: a new or changed shard re-runs the stage.
    return [str(p) for p in source_files(dataset["path"], split=dataset.get("split"))]


def shard_files(wildcards):
    plan_file = checkpoints.plan_shards.get(dataset=wildcards.dataset).output.plan
    with open(plan_file) as fh:
        plan = json.load(fh)
    shards = [layout.shard_name(s["shard"]) for s in plan["shards"]]
    return expand(rules.hidden_states.output.shard, dataset=wildcards.dataset, shard=shards)


def final_targets():
    targets = expand(rules.validate.output.manifest, dataset=DATASETS)
    targets += [rules.draft_vocab.output.mapping, rules.draft_vocab.output.summary]
    targets += [rules.report.output.summary]  # and the report's pictures (rules/report.smk)
    if config["export"]["specforge"]:
        targets += expand(rules.export_specforge.output.directory, dataset=DATASETS)
    if config["export"]["speculators"]:
        targets += [rules.export_speculators.output.directory]
    if config["draft_check"]["enabled"]:
        targets += [rules.draft_check.output.summary]
    return targets


_PREVIEW_SHOWN = []


def show_preview_on_dry_run():
    """Print the hidden-state byte estimate once per dry run.

    Called from input functions: they run while the DAG is built, when
    workflow.dryrun is known (at parse time it is always False).
    """
    if workflow.dryrun and not _PREVIEW_SHOWN:
        _PREVIEW_SHOWN.append(True)
        from eagle3data.monitor.preview import preview_lines

        for line in preview_lines(config):
            logger.info(line)
        logger.info(next_phase_line(config))


def all_targets(wildcards):
    show_preview_on_dry_run()
    return final_targets()


def plan_shards_input(wildcards):
    show_preview_on_dry_run()
    inputs = {
        "tokenized": rules.tokenize.output.tokenized,
        "tokenize_stats": rules.tokenize.output.stats,
        "model": model_config_file(),
    }
    if capture_waits_for_all(config):
        # Generation, then capture (phases.py): on GPUs the capture shares with generation,
        # no dataset's capture starts before every dataset is generated and tokenized.
        inputs["phase_1"] = expand(rules.tokenize.output.stats, dataset=DATASETS)
    return inputs
