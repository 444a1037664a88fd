"""A client process for the fault tests: starts a remote deliver, says so, then waits to be killed.

    python remote_fault_client.py TARGET_ENDPOINT SOURCE_ENDPOINT KEY SPANS SLOT_BYTES WARM

With WARM=1 it first completes one remote deliver (so the source knows this client's
agent and regions), prints ``warm``, and waits for a line on stdin. Then it issues the
deliver it will not see the end of, prints ``sent``, and waits. It exits by itself after
60 s so that it can never outlive a broken test for long.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from kvcr_client import Client, KeyStatus, Span


def main() -> None:
    target, source, key = sys.argv[1], sys.argv[2], sys.argv[3].encode()
    spans, slot, warm = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "1"
    client = Client(target, name="doomed")
    buf = np.zeros(spans * slot, np.uint8)
    region = client.register(buf)
    client.submit_hint("doomed", source, [key]).result(10)
    dst = {key: [Span(f"L{i}", region, i * slot, slot) for i in range(spans)]}
    if warm:
        status = client.deliver(dst, request_id="doomed").result(10)[key].status
        print("warm" if status is KeyStatus.OK else f"warm failed: {status}", flush=True)
        sys.stdin.readline()
    handle = client.deliver(dst, request_id="doomed")
    print("sent", flush=True)
    end = time.monotonic() + 60
    while time.monotonic() < end and not handle.done():
        time.sleep(0.05)
    print("done" if handle.done() else "gave up", flush=True)


if __name__ == "__main__":
    main()
