"""Online runtime: KV cache in pinned CPU memory, one-layer-ahead speculation, selective prefetch.

Reads artifacts (``infinigen.artifacts``); never imports ``prepare`` nor its clients (``eval``,
``bench``, ``cli``). Importing this package is cheap: torch and transformers load with the first
name that needs them (``RuntimeConfig`` needs neither).

    model, tokenizer = infinigen.load("smollm2-135m", artifact="skewed/")
    with infinigen.cache_for(model, budget=0.2) as cache:
        model.generate(**tokenizer(text, return_tensors="pt"), past_key_values=cache, max_new_tokens=64)
        # or with each decode step replayed as one CUDA graph:
        model.generate(..., past_key_values=cache, custom_generate=infinigen.decode)

A cache connects itself to the model while it lives (until ``close()``, the end of the ``with``
block, or its collection); other forwards of the model run as before.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from infinigen.errors import InfinigenError
from infinigen.runtime.config import RuntimeConfig, config_from

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from infinigen.artifacts import Artifact
    from infinigen.runtime.cache import InfinigenCache
    from infinigen.runtime.cache.prompts import PromptCache
    from infinigen.runtime.memory.plan import MemoryPlan

_LAZY = {
    "InfinigenCache": "infinigen.runtime.cache",
    "PromptCache": "infinigen.runtime.cache.prompts",
    "StepGraph": "infinigen.runtime.generation",
    "cache_argument": "infinigen.runtime.generation",
    "decode": "infinigen.runtime.generation",
    "POLICIES": "infinigen.runtime.selection.policies",
    "reserve_host_memory": "infinigen.runtime.memory.host_memory",
    "host_pool_size": "infinigen.runtime.memory.sizing",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'infinigen.runtime' has no attribute {name!r}")


def load(
    model: str | None = None,
    *,
    artifact: str | Path | None = None,
    device: str | None = None,
    dtype: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load MODEL (alias, Hub id, folder, GGUF; default: embedded SmolLM2) and check its artifact.

    The checked artifact is kept on the model (``model.infinigen_artifact``) for ``cache_for``.
    """
    from infinigen.artifacts import open_artifact, read_artifact
    from infinigen.models import load_model
    from infinigen.runtime.memory import allocator

    read = read_artifact(artifact)  # refused before the weights load
    allocator.before_cuda()  # PyTorch's allocator as the memory plan assumes it
    loaded = load_model(model, device=device, dtype=dtype)
    loaded.model.infinigen_artifact = open_artifact(read, loaded.model) if read is not None else None
    return loaded.model, loaded.tokenizer


def cache_for(
    model: PreTrainedModel,
    artifact: Artifact | str | Path | None = None,
    *,
    plan: MemoryPlan | None = None,
    prompts: PromptCache | None = None,
    **settings,
) -> InfinigenCache:
    """A fresh cache for one ``model.generate`` call, connected to ``model`` until it is closed
    (``close()``, or as a context manager) or collected. ``settings`` are ``RuntimeConfig`` fields
    (policy, budget, alpha, min_tokens, dense_layers, cpu_pool_gb, eviction, gpu_memory_gb,
    reuse_rows, ...); None stands for a field's default.

    The cache runs under a memory plan: ``plan`` (``memory.plan``'s, for the run it was made for; then no
    ``settings``), else its own, made at its first prefill within ``gpu_memory_gb`` or the device's free
    memory (``runtime.cache.planning``). ``prompts``: kept prompts (``PromptCache``) that ``infinigen.decode``
    starts each row's prompt from (computing only the rest; a batch's a row at a time) and adds it to; with a
    ``plan``, the least recently used are evicted first where the host cannot hold its run beside them."""
    from infinigen.artifacts import open_artifact
    from infinigen.runtime.cache import InfinigenCache
    from infinigen.runtime.memory.plan import cache_settings

    if isinstance(artifact, (str, Path)):
        artifact = open_artifact(artifact, model)
    artifact = artifact or getattr(model, "infinigen_artifact", None)
    if plan is not None:
        if settings:
            raise InfinigenError("cache_for takes a plan or settings, not both: the plan's settings run")
        settings = cache_settings(plan)
        if prompts is not None:  # the run's pool before kept prompts, where the host cannot hold both
            prompts.make_room(plan)
    return InfinigenCache(model, config_from(settings), artifact, plan, prompts)


__all__ = [
    "POLICIES",
    "InfinigenCache",
    "PromptCache",
    "RuntimeConfig",
    "StepGraph",
    "cache_argument",
    "cache_for",
    "decode",
    "host_pool_size",
    "load",
    "reserve_host_memory",
]
