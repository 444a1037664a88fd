"""The operations a client (or, for ``write``, a peer) asks of a node: one module per family."""
