"""The cache: ``InfinigenCache`` (a transformers ``Cache``) and everything that ties it to a model's
forward. Its per-layer caches (``layers``: dense, offloaded; ``sliding``: window rings), the attention
function transformers calls (``attention``), the forward hooks that connect a cache to its model and
remove themselves with the last cache (``hooks``), the CUDA graphs of selections and steps
(``graphs``), counters and the run's summary (``stats``), and the
diagnostics switches of ``bench --breakdown`` / ``eval --recall`` (``diagnostics``). It owns a
cache's lifetime: it builds pools (``memory``) and policies (``selection``) and orders their work on
the side streams (``runtime.streams``); where the plan streams weights (``RuntimeConfig.streamed_layers``)
and the caller does not, it streams them for its lifetime (``runtime.weights``)."""

from infinigen.runtime.cache.cache import InfinigenCache

__all__ = ["InfinigenCache"]
