"""Engine integrations: each imports its engine (and torch) only when it is imported itself.

``kvcr_client.integrations.transformers``: a transformers cache delivered from kvcr layer
by layer, and the deposit of a prefix's per-layer KV. Nothing in ``kvcr_client`` imports
these modules; the core never imports torch.
"""
