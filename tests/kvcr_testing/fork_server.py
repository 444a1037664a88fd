"""A process that imports an engine once and runs each engine script in a fork of itself.

Run in an engine environment as ``python fork_server.py MODULE ...`` (``kvcr_testing.engines``
starts it): it imports the modules named (vLLM: 7-11 s of every engine process here, most of
a short test run's time), then reads requests from its standard input, one JSON line each::

    {"script": PATH, "args": [...], "env": {...}, "stdout": PATH, "stderr": PATH}

and for each forks a child that becomes the script's process: standard output and error go
to the files named, the environment is the one given, ``sys.path`` is what a fresh
interpreter would make of it (the script's folder, then ``PYTHONPATH``, then the
environment's own), and the script runs as ``__main__``; the child exits as an interpreter
does at the script's end (exit handlers, then finalization), with the script's exit status.
The server answers two lines: ``{"pid": N}`` once the child runs (a caller that gives up on
it kills that pid), then ``{"status": N}`` (the exit code, negative for a signal) once it
ended. One run at a time; the server ends when its standard input closes.

It is a script of its own, importing nothing of the tests: the engine environment has no
pytest. Nothing is imported before the fork that the script could want fresh: the modules
named are the engine's own, and the kvcr packages are imported by each child, from the
checkout its ``PYTHONPATH`` names.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import traceback
from typing import Any


def own_path() -> list[str]:
    """This interpreter's ``sys.path`` less what it made of its script and ``PYTHONPATH``: the
    environment's own folders, which every child keeps."""
    made = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    made.add(os.path.dirname(os.path.abspath(__file__)))
    return [p for p in sys.path if os.path.abspath(p or ".") not in made]


def become(request: dict[str, Any], base_path: list[str]) -> int:
    """In the child: the script's process, run to its end; its exit status."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        out = os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, fd)
        os.close(out)
    env: dict[str, str] = request["env"]
    os.environ.clear()
    os.environ.update(env)
    script = os.path.abspath(request["script"])
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(script), *extra, *base_path]
    sys.argv[:] = [script, *request["args"]]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except BaseException:  # what an interpreter prints for an uncaught exception, and its status
        traceback.print_exc()
        return 1
    return 0


def answer(line: dict[str, int]) -> None:
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


def serve() -> int | None:
    """Serve requests until standard input closes (None); in a child, the script's exit status."""
    base_path = own_path()
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            return become(request, base_path)
        answer({"pid": pid})
        _, status = os.waitpid(pid, 0)
        answer({"status": os.waitstatus_to_exitcode(status)})
    return None


def main() -> None:
    for module in sys.argv[1:]:
        importlib.import_module(module)
    answer({"ready": os.getpid()})
    code = serve()
    if code is not None:
        sys.exit(code)  # the child: leave as the script's interpreter would


if __name__ == "__main__":
    main()
