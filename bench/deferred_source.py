"""``kvcr-node`` whose source side submits peer writes a loop turn late (measurement only).

The product submits a peer write's READY keys in the turn that decoded the request
(architecture §4). To measure what that saves, ``bench/remote.py`` starts one source node
through this launcher, which sets ``kvcr_node.source.SUBMIT_WRITES_NEXT_TURN`` in its own
process and then runs the node exactly as ``kvcr-node`` does (same flags). Nothing else
sets the hook.

Run: ``python bench/deferred_source.py --endpoint ipc:///tmp/x.sock --pool kv:64KiB:64``.
"""

from __future__ import annotations

import sys

import kvcr_node.source
from kvcr_node.cli import main

if __name__ == "__main__":
    kvcr_node.source.SUBMIT_WRITES_NEXT_TURN = True
    sys.exit(main())
