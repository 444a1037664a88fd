"""The engine environment (``scripts/engines_env.sh``) and the engine scripts tests run in it.

The integrations' tests run engine code (torch, transformers, SGLang) in its own
environment, ``.venv-engines``, never in the project's: the core never imports torch.
Outside CI a test module without that environment is skipped, saying why; in CI it fails,
since ``.ci/run`` makes the environment first.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENGINE_PY = ROOT / os.environ.get("KVCR_ENGINES_VENV", ".venv-engines") / "bin" / "python"
"""transformers, SGLang."""
VLLM_PY = ROOT / os.environ.get("KVCR_VLLM_VENV", ".venv-vllm") / "bin" / "python"
"""vLLM (its transformers pin differs, so it has an environment of its own)."""
DYNAMO_PY = ROOT / os.environ.get("KVCR_DYNAMO_VENV", ".venv-dynamo") / "bin" / "python"
"""NVIDIA Dynamo's router index (``scripts/dynamo_env.sh``)."""
EXAMPLES = ROOT / "examples"
SMOLLM2_HF = ENGINE_PY.parents[1] / "smollm2-135m-instruct-hf"
"""SmolLM2-135M-Instruct as a Hugging Face folder (``scripts/smollm2_hf.py``'s default place,
which ``scripts/engines_env.sh`` fills): what vLLM serves, and what the transformers example
loads."""


def smollm2_hf(timeout_s: float = 900.0) -> Path:
    """``SMOLLM2_HF``, written now where the engine environment lacks it (an environment made
    before it held the folder)."""
    subprocess.run([str(ENGINE_PY), str(ROOT / "scripts" / "smollm2_hf.py"), str(SMOLLM2_HF)], check=True,
                   timeout=timeout_s)
    return SMOLLM2_HF


def require_engines(python: Path = ENGINE_PY, made_by: str = "scripts/engines_env.sh") -> None:
    """Skip the calling test module (fail it in CI) when the engine environment is missing."""
    if python.exists():
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI needs the environment {python}: .ci/run makes it with {made_by}", pytrace=False)
    pytest.skip(f"no environment at {python}: run {made_by}", allow_module_level=True)


def run_example(script: str, *args: str, timeout_s: float, python: Path = ENGINE_PY,
                env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``examples/SCRIPT`` in an engine environment; its last line is its JSON report."""
    return run_script(EXAMPLES / script, *args, timeout_s=timeout_s, python=python, env=env)


def run_script(script: Path, *args: str, timeout_s: float, python: Path = ENGINE_PY,
               env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run a script in an engine environment (``env`` added to this process's); its last line
    is its JSON report."""
    return run_script_output(script, *args, timeout_s=timeout_s, python=python, env=env)[0]


def checkout_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment plus ``env``, with this checkout (and its protocol package)
    first on ``PYTHONPATH``: an engine environment installs kvcr in editable mode from
    wherever it was made, so without it an engine script could import another checkout's
    kvcr (a second worktree's, sharing the environment) and test code other than this.

    ``torch.compile`` is off (``TORCH_COMPILE_DISABLE``): vLLM compiles its sampler's logprob
    gather even for an eager model, 2.5 s of every engine process the tests start, and a
    test's runs compare with each other, never with a compiled engine."""
    merged = {**os.environ, "HF_HUB_OFFLINE": "1", "TORCH_COMPILE_DISABLE": "1", **(env or {})}
    merged["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), str(ROOT / "protocol"), merged.get("PYTHONPATH"))))
    return merged


def run_script_output(script: Path, *args: str, timeout_s: float, python: Path = ENGINE_PY,
                      env: dict[str, str] | None = None) -> tuple[dict[str, Any], list[str]]:
    """``run_script``, and every line the script wrote before its report (stdout, then stderr)."""
    proc = subprocess.run([str(python), str(script), *args], capture_output=True, text=True,
                          timeout=timeout_s, env=checkout_env(env))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    report: dict[str, Any] = json.loads(lines[-1])
    return report, lines[:-1] + proc.stderr.splitlines()
