"""Helpers of kvcr's tests, imported by module: ``from kvcr_testing.nodes import start_node``.

``tests/`` is on ``sys.path`` through pytest's ``pythonpath`` setting (pyproject.toml), and
``tests/conftest.py`` has pytest rewrite the asserts of these modules. A process that a test
starts with a script of its own (``tests/faults/hostile_worker.py``) gets ``tests/`` on its
``PYTHONPATH`` from the test (``kvcr_testing.hostile.Worker``).

- ``nodes``: ``kvcr-node`` processes, short ipc directories, freezing a node; a node in a thread
  of the test; a node driven message by message with a fake clock (``NodeDriver``).
- ``health``: a node's stats, and the checks that it is at rest and consistent.
- ``patterns``: patterned bytes and byte-exact comparison.
- ``layouts``: objects' span layouts, registered buffers, checked round trips through one node.
- ``remote``: two or more nodes with a client each (spec section 12).
- ``hostile``: clients in processes of their own, for the fault and load tests.
- ``measure``: descriptors and resident memory of a process.
- ``sockets``: the TCP sockets a process holds, and where they are bound.
- ``netns``: two network namespaces joined by a veth pair, and UCX's settings in each.
- ``forge``: a client that overwrites a stored object through nothing but a read grant.
- ``engines``: the engine environments and the scripts tests run in them; vLLM's run in forks of
  one process that imported vLLM once (``fork_server.py``, a script of its own).
"""
