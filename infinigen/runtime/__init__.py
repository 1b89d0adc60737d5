"""Online runtime: KV cache in pinned CPU memory, one-layer-ahead speculation, selective prefetch.

Reads artifacts (``infinigen.artifacts``); never imports ``infinigen.prepare``.
"""
