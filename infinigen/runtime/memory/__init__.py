"""Memory: where the KV rows live and what they take. Pinned host blocks made ahead of need
(``host_memory``); one offloaded layer's CPU pool of rows in blocks, written at prefill and decode and
read by the kernels' gather (``pool``); the rows an offloaded layer keeps on the GPU from one step to
the next (``reuse``); and the arithmetic of what a cache's pools take from the model's config and the
settings alone (``sizing``). It reads the policies' declared row formats and flags from ``selection``
and moves rows through ``kernels``; it knows nothing of the cache that owns it."""
