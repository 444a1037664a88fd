"""``kvcr-node`` whose source side submits peer writes late (measurement only).

The product submits a peer write's READY keys in the turn that decoded the request
(architecture §4). To measure what that saves, ``bench/remote.py`` starts one source node
through this launcher: ``DeferredSourceNode`` hands the node a ``source_submit`` hook that
holds each submission, and runs what it holds at the end of the loop turn, after the
turn's timed steps, as a second queue would. It runs the node exactly as ``kvcr-node`` does
(same flags). Nothing in the product holds a write.

Run: ``python bench/deferred_source.py --endpoint ipc:///tmp/x.sock --pool kv:64KiB:64``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import procs  # noqa: F401  (UCX on loopback, as in every benchmark: bench/procs.py)

from kvcr_node.cli import main
from kvcr_node.config import NodeConfig
from kvcr_node.node import Node


class DeferredSourceNode(Node):
    """A node that submits its source side's READY writes at the end of the turn that decoded them."""

    def __init__(self, config: NodeConfig, **kwargs: Any) -> None:
        self.held: list[Callable[[], None]] = []
        """Submissions decoded this turn, not made yet."""
        super().__init__(config, source_submit=self.held.append, **kwargs)

    def _turn(self, events: dict[Any, int], filling: bool) -> None:
        super()._turn(events, filling)
        while self.held:
            # A submission that fails is logged and counted like any step of the loop.
            self._guarded("deferred write", self.held.pop(0))


if __name__ == "__main__":
    sys.exit(main(node_class=DeferredSourceNode))
