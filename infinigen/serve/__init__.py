"""``infinigen serve``: an OpenAI-compatible HTTP server over the runtime (the package's ``serve`` extra).

``make_app(engine)`` (``app``) is a small FastAPI app over an ``Engine`` (``engine``): the model, its artifact
and runtime settings, which decodes the waiting requests in batches, each through a fresh cache under the
memory plan (a request that can never fit is refused before any work), and keeps prompts across requests.
``protocol`` reads requests as the ``openai`` package writes them and builds its responses; ``metrics`` keeps
what ``GET /metrics`` shows. A client of the runtime: nothing in ``infinigen.runtime`` imports it.
"""

MAX_BATCH = 8  # requests a batch takes at most, whatever the plan admits (``serve --max-batch``)
