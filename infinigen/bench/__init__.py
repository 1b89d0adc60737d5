"""Speed, a client of the runtime: decode steps of every policy timed in one process (``runs``),
micro-benchmarks of the gather and the speculation (``micro``), random-weight model shapes
(``shapes``) and their plots. The runtime never imports this package."""

# transformers' own caches, benchmarked beside the policies; hf-accelerate: DynamicCache with accelerate's
# offloading of the weights that do not fit (``bench.accelerate_offload``), hf-accelerate-offloaded: the same
# with transformers' offloaded cache
ACCELERATED = {"hf-accelerate": "hf-dynamic", "hf-accelerate-offloaded": "hf-offloaded"}  # -> the cache it runs
HF_BASELINES = ("hf-dynamic", "hf-offloaded", *ACCELERATED)
