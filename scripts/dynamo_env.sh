#!/usr/bin/env bash
# The optional Dynamo environment, made with pip, never part of uv.lock (the core never
# imports dynamo):
# - .venv-dynamo: kvcr with ai-dynamo-runtime (NVIDIA Dynamo's Python bindings, whose
#   dynamo.llm.RadixTree is the KV-aware router's block index), to check kvcr's KV events
#   against the index that Dynamo's router builds from them. The wheel runs on the CPU.
# Its Python is the version of the project's .venv (python3 where there is none).
# Idempotent: an environment that already has everything is kept; what is missing is added.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${KVCR_DYNAMO_VENV:-.venv-dynamo}"
py="$venv/bin/python"
base=python3
if [ -x .venv/bin/python ]; then base=.venv/bin/python; fi   # venv makes it from .venv's base
# kvcr's own dependencies that ai-dynamo-runtime does not bring (pyproject.toml): installed
# into an environment made before kvcr needed them too, so it need not be made again.
core_deps() {
  "$1" -m pip install --quiet --disable-pip-version-check "msgpack==1.2.4" "pyzmq==27.3.0" \
    "numpy==2.4.6" "xxhash==4.1.0" "google-crc32c==1.9.0" "rich==15.0.0" "prometheus-client==0.26.0"
}

if [ -x "$py" ]; then core_deps "$py"; fi
if [ -x "$py" ] && "$py" -c "from dynamo.llm import RadixTree; import kvcr_client, kvcr_node" 2>/dev/null; then
  echo "dynamo env: $venv is ready"
  exit 0
fi
"$base" -m venv "$venv"
pip=("$py" -m pip install --quiet --disable-pip-version-check)
# ai-dynamo-runtime 1.6.1 needs pydantic>=2.10.6,<=2.13.5 (and uvloop, which pip resolves).
"${pip[@]}" "ai-dynamo-runtime==1.6.1" "pydantic==2.13.5"
core_deps "$py"
# nixl declares torch but never imports it.
"${pip[@]}" --no-deps "nixl-cu12==1.5.1"
"${pip[@]}" --no-deps -e protocol -e .
"$py" -c "import importlib.metadata as m; from dynamo.llm import RadixTree; import kvcr_client, kvcr_node; print('dynamo env: ai-dynamo-runtime', m.version('ai-dynamo-runtime'))"
