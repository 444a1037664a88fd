"""ZeroMQ flags as plain ints: pyzmq's flag enums cost a Python call per use on hot paths."""

from __future__ import annotations

import zmq

EVENTS = int(zmq.EVENTS)
POLLIN = int(zmq.POLLIN)
NOBLOCK = int(zmq.NOBLOCK)
SNDMORE = int(zmq.SNDMORE)
