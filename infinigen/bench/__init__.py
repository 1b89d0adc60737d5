"""Speed, a client of the runtime: decode steps of every policy timed in one process (``runs``),
micro-benchmarks of the gather and the speculation (``micro``), random-weight model shapes
(``shapes``) and their plots. The runtime never imports this package."""

HF_BASELINES = ("hf-dynamic", "hf-offloaded")  # transformers' own caches, benchmarked beside the policies
