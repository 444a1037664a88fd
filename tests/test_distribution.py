"""kvcr installs as ``kvcr-runner``, beside the upstream KV Cache Runner (``kvcr`` on the registry).

The upstream package is published as the distribution ``kvcr`` with one import package,
``kvcr``, and vLLM's OffloadingConnector imports it for its ``kvcr`` tier. This project's
distribution is ``kvcr-runner`` (import packages ``kvcr_client``, ``kvcr_node``, ``kvcr_io``,
and ``kvcr_protocol`` from ``kvcr-protocol``): one environment holds both, each keeps its
own files, and removing one leaves the other working.

The test makes a fresh environment with uv and installs this checkout (built as a wheel)
with its dependencies, then upstream ``kvcr==0.1.1`` from the registry. Upstream pins
``nixl==1.5.0``, the NIXL meta package whose ``nixl`` module it imports; its CUDA builds
(``nixl-cu12==1.5.0``, ``nixl-cu13``) would replace this project's ``nixl-cu12``, so the
meta package goes in without them and its module finds the build this project installed,
as an engine environment holding both would. Outside CI, without uv or the registry, it is
skipped, saying why; in CI it must run (``.ci/run`` installs uv, which fills its cache).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM = "kvcr==0.1.1"
UPSTREAM_NIXL = "nixl==1.5.0"
INSTALL_S = 600.0
RUN_S = 120.0

PROBE = """
import importlib.metadata as m, json, pathlib
import kvcr, kvcr_client, kvcr_protocol
from kvcr_node.node import Node
def files(dist):
    return sorted(str(f) for f in m.files(dist) or ())
print(json.dumps({
    "versions": {d: m.version(d) for d in ("kvcr", "kvcr-runner", "kvcr-protocol")},
    "files": {d: files(d) for d in ("kvcr", "kvcr-runner")},
    "upstream": kvcr.__file__, "client": kvcr_client.__file__, "upstream_api": hasattr(kvcr, "KVCRClient"),
    "our_api": hasattr(kvcr_client, "Client") and Node is not None,
}))
"""


def uv() -> str:
    found = shutil.which("uv") or shutil.which("uv", path=str(Path(sys.executable).parent))
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("CI needs uv (.ci/run installs it)", pytrace=False)
        pytest.skip("uv is not installed")
    return found


def checkout(to: Path) -> Path:
    """The checkout's files (tracked, and new ones git does not ignore) copied to ``to``: built
    from there, a wheel holds what the sources say, not what a local ``build/`` kept."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True, timeout=RUN_S).stdout
    for name in filter(None, listed.decode().split("\0")):
        path = ROOT / name
        if path.is_file():
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, to / name)
    return to


def run(*args: str, cwd: Path, timeout: float = RUN_S) -> str:
    # Without the suite's PYTHONPATH (this checkout's folders): only what the environment installed.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"{' '.join(args)}: {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.timeout(2 * INSTALL_S)
def test_kvcr_runner_and_the_upstream_kvcr_install_side_by_side(tmp_path: Path) -> None:
    tool = uv()
    env = tmp_path / "env"
    python = str(env / "bin" / "python")
    run(tool, "venv", "-q", "--python", sys.executable, str(env), cwd=tmp_path)
    # This project first, its dependencies resolved as a user's install would, torch kept out as
    # pyproject's override-dependencies keep it out of uv.lock (the NIXL wheels declare it, never import it).
    overrides = tmp_path / "overrides.txt"
    overrides.write_text("torch; sys_platform == 'never'\n")
    source = checkout(tmp_path / "src")
    run(tool, "pip", "install", "-q", "--python", python, "--override", str(overrides), str(source / "protocol"),
        str(source), cwd=tmp_path, timeout=INSTALL_S)
    ours = run(str(env / "bin" / "kvcr"), "version", cwd=tmp_path).strip()
    try:
        run(tool, "pip", "install", "-q", "--python", python, "--no-deps", UPSTREAM, UPSTREAM_NIXL, cwd=tmp_path,
            timeout=INSTALL_S)
        run(tool, "pip", "install", "-q", "--python", python, "msgspec>=0.21,<1", cwd=tmp_path, timeout=INSTALL_S)
    except AssertionError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"the registry is not reachable: {str(exc).splitlines()[0]}")

    report = json.loads(run(python, "-c", PROBE, cwd=tmp_path).strip().splitlines()[-1])
    assert report["versions"]["kvcr"] == "0.1.1", report["versions"]
    assert report["versions"]["kvcr-runner"] == ours != "unknown", (report["versions"], ours)
    site = str(env)
    assert report["upstream"].startswith(site) and report["client"].startswith(site), report
    assert report["upstream_api"] and report["our_api"], report
    upstream, runner = (set(report["files"][d]) for d in ("kvcr", "kvcr-runner"))
    assert upstream and runner and not upstream & runner, sorted(upstream & runner)
    assert not any(f.startswith("kvcr/") for f in runner), "kvcr-runner ships a file in upstream's package"
    # Every module of the checkout is installed (setuptools ships only the packages pyproject names).
    sources = {str(f.relative_to(source)) for pkg in ("kvcr_io", "kvcr_node", "kvcr_client")
               for f in (source / pkg).rglob("*.py")}
    assert sources <= runner, sorted(sources - runner)
    # `kvcr version` names this project's version, not the upstream distribution's.
    assert run(str(env / "bin" / "kvcr"), "version", cwd=tmp_path).strip() == ours

    # Removing upstream leaves kvcr-runner whole, and the other way round.
    run(tool, "pip", "uninstall", "-q", "--python", python, "kvcr", cwd=tmp_path)
    run(python, "-c", "import kvcr_client, kvcr_node; from kvcr_client import Client", cwd=tmp_path)
    assert run(str(env / "bin" / "kvcr"), "version", cwd=tmp_path).strip() == ours
    run(tool, "pip", "install", "-q", "--python", python, "--no-deps", UPSTREAM, cwd=tmp_path, timeout=INSTALL_S)
    run(tool, "pip", "uninstall", "-q", "--python", python, "kvcr-runner", cwd=tmp_path)
    run(python, "-c", "import kvcr; assert hasattr(kvcr, 'KVCRClient')", cwd=tmp_path)
