"""MkDocs hooks of the documentation site (``mkdocs.yml``; ``uv run --group docs mkdocs build --strict``).

The site is ``docs/`` as it is, plus pages made at build time from the repository's own
sources, so none can drift from the code:

- ``index.md``: the README (its links into ``docs/`` and ``spec/`` pointed at the site's pages);
- ``protocol.md``: the protocol specification, ``spec/kvcr-protocol.md``;
- ``reference/configuration.md``: every key of a node's TOML file with its flag, type,
  default and meaning, from ``kvcr_node.config`` (``TOML_FIELDS``, ``NodeConfig`` and its
  field docstrings) and ``kvcr-node``'s own argument parser;
- ``reference/metrics.md``: every family the node's exporter serves, with type, labels and
  help, from ``kvcr_node.metrics_text`` rendering a snapshot that has every family.

And it checks the written pages against the code: a metric name (```kvcr_...```,
```vllm:kvcr_...```) the exporter or the vLLM connector does not have, a key in a ``toml``
block that a node's TOML file does not take, or a ``kvcr-node`` flag in a shell block its
parser does not know, is a warning, which ``--strict`` makes a failed build (as it makes
a broken link one).
"""

from __future__ import annotations

import ast
import dataclasses
import logging
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

from kvcr_node.cli import _parser
from kvcr_node.config import POOL_FIELDS, TOML_FIELDS, NodeConfig
from kvcr_node.metrics import Histogram, MetricsSnapshot, PoolSnapshot
from kvcr_node.metrics_text import Dropped, render, render_exporter

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("mkdocs.plugins.kvcr")

PACKAGES = {"kvcr_client", "kvcr_node", "kvcr_io", "kvcr_protocol", "kvcr_testing"}
NOT_METRICS = {"kvcr_endpoint"}
"""Names in backticks that start ``kvcr_`` and are neither a package nor a metric: the key
a vLLM request's ``kv_transfer_params`` names its source with."""
SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created", "_info")


# -- pages made from the sources -------------------------------------------------------


def _site_links(markdown: str, prefix: str) -> str:
    """Links written for the repository (``docs/x.md``, ``spec/kvcr-protocol.md``), as the site's."""
    return markdown.replace(f"]({prefix}spec/kvcr-protocol.md", "](protocol.md").replace("](docs/", "](")


def _field_docs() -> dict[str, str]:
    """``NodeConfig``'s field docstrings, by field (read from its source: Python keeps none)."""
    source = (ROOT / "kvcr_node" / "config.py").read_text()
    (cls,) = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "NodeConfig"]
    docs: dict[str, str] = {}
    for stmt, after in zip(cls.body, cls.body[1:], strict=False):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


def _flags() -> dict[str, tuple[str, str]]:
    """``kvcr-node``'s flags by the field they set: (flag as typed, help)."""
    out: dict[str, tuple[str, str]] = {}
    for action in _parser()._actions:
        if action.dest in ("help", "version") or not action.option_strings:
            continue
        out[action.dest] = (" / ".join(action.option_strings), action.help or "")
    return out


def _cell(text: str) -> str:
    """Text as one cell of a Markdown table."""
    return " ".join(text.split()).replace("|", "\\|")


def _type_name(kind: type | tuple[type, ...]) -> str:
    return "number" if isinstance(kind, tuple) else {str: "string", int: "integer", bool: "boolean"}[kind]


def _default(field: dataclasses.Field[Any]) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
        return "none" if value is None or value == "" else f"`{str(value).lower() if isinstance(value, bool) else value}`"
    return {"endpoint": "`ipc:///tmp/kvcr-UID/node.sock` (per user)", "name": "`kvcr-node-PID`"}.get(field.name, "computed")


def configuration_page() -> str:
    fields = {f.name: f for f in dataclasses.fields(NodeConfig)}
    docs, flags = _field_docs(), _flags()
    rows = []
    for key, kind in TOML_FIELDS.items():
        flag, help_text = flags.get(key, ("", ""))
        meaning = _cell(docs.get(key) or help_text or "(undocumented)")
        rows.append(f"| `{key}` | {f'`{flag}`' if flag else 'TOML only'} | {_type_name(kind)} | "
                    f"{_default(fields[key])} | {meaning} |")
    pools = ", ".join(f"`{k}`" for k in POOL_FIELDS)
    return "\n".join([
        "# Configuration reference",
        "",
        "Every key a node's TOML file (`kvcr-node --config FILE`) takes, with the flag that sets it",
        "(flags override the file), its type, its default and its meaning. This page is made from",
        "the code (`kvcr_node.config.TOML_FIELDS`, `NodeConfig` and `kvcr-node`'s parser) each time the",
        "site is built. How to run a node, and what each part does: [Running a node](../node.md).",
        "",
        "| key | flag | type | default | meaning |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "## Pools",
        "",
        f"Pools are `[[pools]]` tables ({pools}) or `--pool NAME:SLOT_SIZE:SLOT_COUNT[:MEMORY]` flags",
        "(repeatable; flags replace the file's pools). `memory` is `dram` (the default), `hbm:N`",
        "(GPU N) or `disk:/DIR` (the disk tier). Without any, a node has one DRAM pool `kv`.",
        "",
        f"Flags without a TOML key: {', '.join(f'`{flag}`' for dest, (flag, _) in flags.items() if dest not in TOML_FIELDS)}.",
        "",
    ])


def example_snapshot() -> MetricsSnapshot:
    """A snapshot in which every family the exporter knows has a sample (the disk tier too)."""
    h = Histogram()
    h.observe(0.001)
    pool = PoolSnapshot("kv", "dram", 65536, 16, 8, 4, 4, 0, 0, 0, 0, 0)
    return MetricsSnapshot(
        node="n", version="v", incarnation=1, protocol_version=5, lookups=0, hits=0, pools=(pool,), objects=0,
        writing=0, claims=(("handles", 0),), leases=0, clients=0, peer_sessions=0, operations_pending=0,
        transfers_inflight=0, latency=(("query", h.frozen()),), first_layer=h.frozen(),
        results=(("deliver", "failed", "NOT_FOUND", 1),), protocol_errors=(("BAD_REQUEST", 1),),
        links=(("ready", 0),), uncertain_writes=0, counters=(), disk_tier=(("demoted", 0),), disk_copies=0,
        disk_bytes=(("demoted", 0),), disk_latency=(("write", h.frozen()),), disk_recovery=(("recovered", 0),))


def families() -> dict[str, tuple[str, str, list[str]]]:
    """Every family the exporter serves: name -> (type, help, labels)."""
    text = render(example_snapshot()).decode() + render_exporter(0, dict.fromkeys(Dropped, 0)).decode()
    out: dict[str, tuple[str, str, list[str]]] = {}
    helps: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, doc = line[len("# HELP "):].partition(" ")
            helps[name] = doc.replace("\\\\", "\\").replace("\\n", "\n")
        elif line.startswith("# TYPE "):
            name, kind = line[len("# TYPE "):].split()
            out[name] = (kind, helps.get(name, ""), [])
        elif line and not line.startswith("#"):
            sample = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?", line)
            assert sample is not None, line
            family = next((f for f in out if sample.group(1) == f or sample.group(1).startswith(f + "_")), None)
            if family is not None and sample.group(3):
                labels = out[family][2]
                for label in re.findall(r'([a-zA-Z_]+)="', sample.group(3)):
                    if label not in labels and label != "le":
                        labels.append(label)
    return out


def metrics_page() -> str:
    rows = []
    for name, (kind, doc, labels) in families().items():
        rows.append(f"| `{name}` | {kind} | {', '.join(f'`{label}`' for label in labels)} | {_cell(doc)} |")
    return "\n".join([
        "# Metrics reference",
        "",
        "Every family the node's Prometheus exporter serves (`kvcr-node --metrics-port N`), as",
        "`kvcr_node.metrics_text` renders it: made from the code each time the site is built. A",
        "histogram also serves `_bucket`, `_sum` and `_count`; the `kvcr_disk_tier_*` families only",
        "where the node has disk pools. What they mean together, and the Grafana dashboard:",
        "[Metrics](../metrics.md).",
        "",
        "| metric | type | labels | help |",
        "|---|---|---|---|",
        *rows,
        "",
    ])


def on_files(files: Files, config: Any) -> Files:
    readme = (ROOT / "README.md").read_text()
    spec = (ROOT / "spec" / "kvcr-protocol.md").read_text()
    for uri, content in (("index.md", _site_links(readme, "")), ("protocol.md", spec),
                         ("reference/configuration.md", configuration_page()), ("reference/metrics.md", metrics_page())):
        files.append(File.generated(config, uri, content=content))
    return files


# -- checks of the written pages -------------------------------------------------------


class Known:
    """What the code has, for the checks: metric names, TOML keys, ``kvcr-node`` flags."""

    def __init__(self) -> None:
        self.metrics = set()
        for name, (kind, _, _) in families().items():
            family = name.removesuffix("_total") if kind == "counter" else name
            self.metrics |= {name, family, *(family + suffix for suffix in SUFFIXES)}
        source = (ROOT / "kvcr_client" / "integrations" / "vllm_common.py").read_text()
        (counters,) = [n.value for n in ast.parse(source).body if isinstance(n, ast.AnnAssign)
                       and isinstance(n.target, ast.Name) and n.target.id == "COUNTERS"]
        assert isinstance(counters, ast.Dict)
        self.vllm = {f"vllm:kvcr_{ast.literal_eval(k)}_total" for k in counters.keys if k is not None}
        self.toml = set(TOML_FIELDS) | {"pools", *POOL_FIELDS}
        self.flags = {flag for action in _parser()._actions for flag in action.option_strings}


_known: Known | None = None


def _check(markdown: str, page: str) -> None:
    global _known
    known = _known = _known or Known()
    for name in re.findall(r"`(kvcr_[a-z0-9_]+)`", markdown):
        if name not in known.metrics and name not in PACKAGES and name not in NOT_METRICS:
            log.warning("%s: `%s` is not a metric the node's exporter serves", page, name)
    for name in re.findall(r"`(vllm:kvcr_[a-z0-9_]+)`", markdown):
        if name not in known.vllm:
            log.warning("%s: `%s` is not a counter the vLLM connector exports", page, name)
    for lang, block in re.findall(r"```(\w*)\n(.*?)```", markdown, flags=re.S):
        if lang == "toml":
            for key in re.findall(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=", block, flags=re.M):
                if key not in known.toml:
                    log.warning("%s: `%s` in a toml block is not a key of a node's TOML file", page, key)
        for line in block.splitlines():
            if re.match(r"\s*(uv run )?kvcr-node\b", line):
                for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", line.split("#", 1)[0]):
                    if flag not in known.flags:
                        log.warning("%s: kvcr-node has no flag %s (%s)", page, flag, line.strip())


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    uri = page.file.src_uri
    if not uri.startswith("reference/") and uri != "protocol.md":
        _check(markdown, uri)
    return _site_links(markdown, "../")
