#!/usr/bin/env bash
# The GPU check: the gpu-marked tests (tests/gpu) and the short GPU benchmark (bench/gpu.py),
# on a machine with one CUDA GPU and no network that has Python 3.12, CUDA 13, CuPy, msgpack
# and numpy but neither nixl nor pyzmq. Run from anywhere inside the repo; exits non-zero when
# a check fails. Takes about a minute or two; bounded at about 4 minutes.
#
# The missing wheels are installed offline from a folder prepared beforehand, on a machine with
# network, in the repo root (about 59 MiB, nixl-cu13 alone 56 MiB; .whl/ is git-ignored):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     nixl-cu13==1.5.1 pyzmq==27.3.0 pytest==9.2.0 pytest-asyncio==1.5.0 pytest-timeout==2.4.0 \
#     pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 pygments==2.21.0 typing-extensions==4.16.0
#
# nixl-cu13 declares numpy and torch: numpy must be there already and torch is never needed
# (nixl does not import it), so neither is downloaded. pytest and its own needs are included
# so that the pytest-asyncio and pytest-timeout that pyproject.toml's options need match it.
#
# Environment: KVCR_WHEELS (wheel folder, default .whl), KVCR_SITE (install target, default
# /tmp/site), PYTHON (default python3).
# Extra arguments go to pytest, e.g. scripts/gpu_check.sh -k 'not cross_node'.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
py=${PYTHON:-python3}
wheels=${KVCR_WHEELS:-.whl}
site=${KVCR_SITE:-/tmp/site}
export PYTHONUNBUFFERED=1 PIP_ROOT_USER_ACTION=ignore

# 1. The missing wheels, offline, into a folder of their own (no pip install of the project).
shopt -s nullglob
whls=("$wheels"/*.whl)
shopt -u nullglob
if ((${#whls[@]})); then
    echo "gpu_check: installing ${#whls[@]} wheel(s) from $wheels into $site"
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${whls[@]}"
else
    echo "gpu_check: no wheels in $wheels; using what is installed" >&2
fi

# 2. The repo importable as installed: kvcr_protocol from its distribution's folder
#    (protocol/), kvcr_node and kvcr_client from the root. Child processes (tests start
#    nodes with `python -m kvcr_node.cli`) inherit PYTHONPATH.
export PYTHONPATH="$site:$root/protocol:$root${PYTHONPATH:+:$PYTHONPATH}"

# 3. UCX's CUDA memory hooks (bundled in nixl-cu13) need libcudart.so.13: when the loader
#    does not know it, point it at the copy a CUDA wheel or the toolkit has.
if ! ldconfig -p 2>/dev/null | grep -q 'libcudart\.so\.13'; then
    cudart=$("$py" - <<'EOF'
import glob, os, site, sys
roots = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
found = [p for r in roots for p in glob.glob(os.path.join(r, "nvidia", "*", "lib", "libcudart.so.13*"))]
found += glob.glob("/usr/local/cuda*/lib64/libcudart.so.13*")
found += glob.glob("/usr/local/cuda*/targets/x86_64-linux/lib/libcudart.so.13*")
print(os.path.dirname(found[0]) if found else "")
EOF
)
    if [[ -n $cudart ]]; then
        echo "gpu_check: libcudart.so.13 from $cudart"
        export LD_LIBRARY_PATH="$cudart${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    else
        echo "gpu_check: warning: libcudart.so.13 not found; UCX may not load its CUDA support" >&2
    fi
fi

# 3b. Some nixl-cu13 builds leave UCX without its bundled CUDA modules ("VRAM memory is
#     detected as host by UCX"); naming the wheel's module folder is harmless where UCX finds
#     it by itself.
if [[ -z ${UCX_MODULE_DIR:-} ]]; then
    shopt -s nullglob
    mods=("$site"/nixl_cu1*.libs/ucx)
    shopt -u nullglob
    if ((${#mods[@]})); then
        export UCX_MODULE_DIR=${mods[0]}
        echo "gpu_check: UCX modules from $UCX_MODULE_DIR"
    fi
fi

# 4. Everything present, and a GPU: say what is missing instead of skipping tests.
"$py" - <<'EOF'
import sys
missing = []
for name in ("numpy", "msgpack", "zmq", "cupy", "pytest", "pytest_asyncio", "pytest_timeout"):
    try:
        __import__(name)
    except ImportError as exc:
        missing.append(f"{name}: {exc}")
try:
    from kvcr_client.agent import load_nixl
    nixl = load_nixl()
except ImportError as exc:
    missing.append(f"nixl (through kvcr_client.agent): {exc}")
if missing:
    sys.exit("gpu_check: missing:\n  " + "\n  ".join(missing))
import cupy
try:
    count = cupy.cuda.runtime.getDeviceCount()
except Exception as exc:
    sys.exit(f"gpu_check: CuPy sees no CUDA device: {exc}")
if count < 1:
    sys.exit("gpu_check: CuPy sees no CUDA device")
name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
print(f"gpu_check: python {sys.version.split()[0]}, {nixl.__name__}, cupy {cupy.__version__}, "
      f"{count} device(s), device 0: {name.decode() if isinstance(name, bytes) else name}")
EOF

# 5. The checks: both run, the status is the first failure's.
status=0
echo "gpu_check: pytest -m gpu tests/gpu"
timeout 150 "$py" -m pytest -m gpu tests/gpu -q -p no:cacheprovider "$@" || status=$?
echo "gpu_check: bench/gpu.py"
timeout 90 "$py" bench/gpu.py || { rc=$?; ((status)) || status=$rc; }
if ((status)); then
    echo "gpu_check: FAILED (exit $status)" >&2
else
    echo "gpu_check: passed"
fi
exit "$status"
