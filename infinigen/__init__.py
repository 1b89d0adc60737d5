"""infinigen: long-context decoding with the KV cache in CPU memory (InfiniGen, OSDI 2024)."""

__version__ = "0.1.0"

_RUNTIME = (
    "load",
    "cache_for",
    "decode",
    "InfinigenCache",
    "PromptCache",
    "RuntimeConfig",
    "StepGraph",
    "reserve_host_memory",
    "host_pool_size",
)


def __getattr__(name: str):
    """``infinigen.load`` / ``infinigen.cache_for`` without importing torch for ``--version``."""
    if name in _RUNTIME:
        from infinigen import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'infinigen' has no attribute {name!r}")
