"""The engine environment (``scripts/engines_env.sh``) and the engine scripts tests run in it.

The integrations' tests run engine code (torch, transformers, SGLang) in its own
environment, ``.venv-engines``, never in the project's: the core never imports torch.
Outside CI a test module without that environment is skipped, saying why; in CI it fails,
since ``.ci/run`` makes the environment first.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import tempfile
import threading
import time
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
    """``run_script``, and every line the script wrote before its report (stdout, then stderr).

    The script's temporary files go to a folder of its own (``TMPDIR``), removed after it:
    vLLM leaves socket files there for every engine. In vLLM's environment the script runs
    in a fork of a process that imported vLLM once (``FORK_SERVERS``); elsewhere in a
    process of its own."""
    with tempfile.TemporaryDirectory(prefix="kvcr-run-") as scratch:
        run_env = checkout_env({**(env or {}), "TMPDIR": scratch})
        if python not in PRELOAD:
            proc = subprocess.run([str(python), str(script), *args], capture_output=True, text=True,
                                  timeout=timeout_s, env=run_env)
            code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        else:
            code, stdout, stderr = fork_server(python).run(script, args, run_env, Path(scratch), timeout_s)
    assert code == 0, stdout[-4000:] + stderr[-4000:]
    lines = stdout.strip().splitlines()
    report: dict[str, Any] = json.loads(lines[-1])
    return report, lines[:-1] + stderr.splitlines()


PRELOAD: dict[Path, tuple[str, ...]] = {VLLM_PY: ("vllm", "vllm.entrypoints.llm", "vllm.v1.core.sched.scheduler")}
"""What the fork server of an engine environment imports once (``fork_server``)."""
SERVER_START_S = 300.0
"""How long a fork server may take to import its engine (a cold disk, a loaded machine)."""
FORK_SERVERS: dict[Path, ForkServer] = {}


def fork_server(python: Path) -> ForkServer:
    """The running fork server of ``python``'s environment (one named in ``PRELOAD``), started
    now where none runs."""
    server = FORK_SERVERS.get(python)
    if server is None or not server.alive():
        server = FORK_SERVERS[python] = ForkServer(python, PRELOAD[python])
    return server


class ForkServer:
    """``fork_server.py`` in an engine environment: each script run in a fork of a process that
    imported the engine once. One run at a time; it ends when this process does (its standard
    input closes), or at ``close``."""

    def __init__(self, python: Path, preload: tuple[str, ...]) -> None:
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([str(python), str(Path(__file__).with_name("fork_server.py")), *preload],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     env=checkout_env(), bufsize=0)
        self._pending = b""
        self._lock = threading.Lock()
        atexit.register(self.close)
        try:
            self._line(time.monotonic() + SERVER_START_S)
        except Exception:
            self.close()
            raise

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, script: Path, args: tuple[str, ...], env: dict[str, str], scratch: Path,
            timeout_s: float) -> tuple[int, str, str]:
        """Run ``script`` with ``args`` and ``env`` in a fork; its exit status, stdout and stderr.
        A run past ``timeout_s`` is killed and raises ``subprocess.TimeoutExpired``."""
        out, err = scratch / "fork-stdout", scratch / "fork-stderr"
        request = {"script": str(script), "args": list(args), "env": env, "stdout": str(out), "stderr": str(err)}
        with self._lock:
            pid = 0
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps(request).encode() + b"\n")
                # The fork answers at once, whatever the run's own time: the run's clock starts now.
                pid = self._line(time.monotonic() + SERVER_START_S)["pid"]
                code: int | None
                try:
                    code = self._line(time.monotonic() + timeout_s)["status"]
                except subprocess.TimeoutExpired:
                    code = None
                    os.kill(pid, signal.SIGKILL)
                    self._line(time.monotonic() + SERVER_START_S)  # its status: the server is free again
            except BaseException:
                # Interrupted mid-run (a test's own timeout, a server that stopped answering):
                # the server's answers are out of step with ours, so it goes, and the next run
                # starts another.
                if pid:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                self.close()
                raise
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        if code is None:
            raise subprocess.TimeoutExpired([str(script), *args], timeout_s, stdout, stderr)
        return code, stdout, stderr

    def _line(self, deadline: float) -> dict[str, int]:
        """The server's next answer, waited for until ``deadline``."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.proc.args, left)
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 4096)
                if not chunk:
                    self._log.seek(0)
                    raise RuntimeError(f"the fork server {self.proc.args} ended: "
                                       + self._log.read().decode(errors="replace")[-4000:])
                self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        answer: dict[str, int] = json.loads(line)
        return answer

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()
