"""The fork server the vLLM tests run their engine scripts in (``kvcr_testing.fork_server``).

A script run in a fork of the process that imported vLLM must see what a process of its own
would: its arguments, the environment it was given (not the server's), its own folder first
on ``sys.path`` and ``PYTHONPATH`` after it, ``__name__ == "__main__"``, its exit handlers
run, its exit status and both its outputs returned. A run past its time is killed and the
server goes on serving the next one; a run interrupted in the caller (a test's own timeout)
ends its script and the server, and the next run gets a new one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from kvcr_testing.engines import VLLM_PY, checkout_env, fork_server, require_engines

require_engines(VLLM_PY)

SCRIPT = '''
import atexit, json, os, sys
atexit.register(lambda: print("exit handler ran", file=sys.stderr))
print(json.dumps({"argv": sys.argv[1:], "name": __name__, "path": sys.path[:4],
                  "marker": os.environ.get("KVCR_FORK_MARKER"), "tmpdir": os.environ.get("TMPDIR"),
                  "vllm_loaded": "vllm" in sys.modules}))
sys.exit(int(sys.argv[1]))
'''


def test_a_forked_script_runs_as_its_own_process_would(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    extra = tmp_path / "extra"
    env = checkout_env({"KVCR_FORK_MARKER": "seen", "TMPDIR": str(tmp_path),
                        "PYTHONPATH": str(extra)})
    server = fork_server(VLLM_PY)
    code, out, err = server.run(script, ("3", "a b"), env, tmp_path, 120.0)
    assert code == 3, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report == {"argv": ["3", "a b"], "name": "__main__", "path": [str(tmp_path), *env["PYTHONPATH"].split(os.pathsep)],
                      "marker": "seen", "tmpdir": str(tmp_path), "vllm_loaded": True}
    assert env["PYTHONPATH"].split(os.pathsep)[-1] == str(extra)
    assert "exit handler ran" in err


def test_a_run_past_its_time_is_killed_and_the_server_serves_on(tmp_path: Path) -> None:
    stuck = tmp_path / "stuck.py"
    stuck.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    server = fork_server(VLLM_PY)
    with pytest.raises(subprocess.TimeoutExpired):
        server.run(stuck, (), checkout_env(), tmp_path, 1.0)
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    code, out, _ = server.run(script, ("0",), checkout_env(), tmp_path, 120.0)
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["argv"] == ["0"]
    assert fork_server(VLLM_PY) is server


class Interrupted(Exception):
    """What a test's own timeout raises in the middle of a run."""


def test_a_run_interrupted_mid_way_ends_its_script_and_the_next_run_gets_a_new_server(tmp_path: Path) -> None:
    stuck = tmp_path / "stuck.py"
    pid_file = tmp_path / "pid"
    stuck.write_text(f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n")
    server = fork_server(VLLM_PY)

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    def once_started() -> None:
        end = time.monotonic() + 120.0
        while not pid_file.exists() and time.monotonic() < end:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        threading.Thread(target=once_started, daemon=True).start()
        with pytest.raises(Interrupted):
            server.run(stuck, (), checkout_env(), tmp_path, 300.0)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert not server.alive()
    script_pid = int(pid_file.read_text())
    end = time.monotonic() + 30.0
    while Path(f"/proc/{script_pid}").exists() and Path(f"/proc/{script_pid}/stat").read_text().split()[2] != "Z" \
            and time.monotonic() < end:
        time.sleep(0.05)
    assert not Path(f"/proc/{script_pid}").exists() or Path(f"/proc/{script_pid}/stat").read_text().split()[2] == "Z"
    fresh = fork_server(VLLM_PY)
    assert fresh is not server
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    code, out, _ = fresh.run(script, ("0",), checkout_env(), tmp_path, 120.0)
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["vllm_loaded"] is True
