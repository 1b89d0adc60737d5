"""The memory plan a cache runs under (``memory.plan``), whoever drives it.

A client that plans its run (the command line, batch jobs, eval, bench) hands the cache its plan
(``cache_for(model, artifact, plan=found)``). A cache made without one plans at its first prefill from
what it then sees, within ``gpu_memory_gb`` or the device's free memory: ``infinigen.decode`` tells it the
batch, the prompt, the new tokens and the chunk asked before the prefill (``plan_run``), and takes the
plan's chunk where the caller gives none or a larger one; under transformers' own loop the first forward
is planned as it arrives (its tokens, padding, the run's length where ``expect`` gave it; its decode steps
capture each layer's selection as a graph of its own, which the plan counts). The cache takes the plan's
settings (its layers are made again: no KV is stored yet).

Every later forward is checked against the plan before it allocates (``check_forward``, from the decoder
stack's pre-hook): a host comparison while the run stays within the planned sizes; a run that outgrows
them (transformers' chunked prefill, a decode loop that did not say its length; exact decoding's verifications
count as decode steps) is planned again with
the settings running, and refused in one line where it no longer fits. A forward of more prompt tokens
at once than the plan fits is refused in one line naming ``infinigen.decode`` and the chunk that fits.
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch

from infinigen.errors import InfinigenError
from infinigen.runtime.config import MOST_DRAFTS, RuntimeConfig
from infinigen.runtime.memory import plan
from infinigen.runtime.memory.plan import MemoryPlan, Workload

PREFILL_ONLY = ("prefill_fetch_ahead", "prefill_block_tokens")  # read per forward: a grown plan may change them


def plan_run(cache, work: Workload) -> MemoryPlan:
    """The plan ``cache`` runs ``work`` under, its chunk at most the one asked (``work.prefill_chunk``;
    None: any). A cache that holds no KV yet and has no plan covering ``work`` plans it now and takes its
    settings; one that holds KV has its plan grown with its settings. Refused in one line
    (``InfinigenError``) where it does not fit."""
    current = cache.memory_plan
    if current is not None and _covers(current.workload, work, chunk_at_most=True):
        return current
    if current is not None and any(layer.is_initialized for layer in cache.layers):
        return _grown(cache, work)
    found = _planned(cache, work, cache.asked, plan.budget_bytes(cache.asked.gpu_memory_gb, cache.device))
    if why := plan.why_not(found):
        raise InfinigenError(why)
    config, cache.memory_plan = RuntimeConfig(**plan.cache_settings(found)), found
    if config != cache.config:
        model = cache.model_ref()
        if model is None:
            raise InfinigenError("this cache's model is gone")
        cache.configure(model, config)  # names the plan's reuse decision too
    else:
        cache.reuse_from_plan()
    return found


def check_forward(cache, batch: int, tokens: int, mask: torch.Tensor | None) -> None:
    """Before a forward of ``tokens`` tokens a row (B = ``batch``) through ``cache``: plan it where the cache
    has no plan, else check it stays within the plan (or grows it); refused in one line before anything
    is allocated where it does not fit."""
    held = cache.get_seq_length()
    total, current = held + tokens, cache.memory_plan
    # exact decoding's verification (the last token and the drafts) is decoding's, which the plan counts
    verifying = cache.config.exact and held > 0 and tokens <= (cache.config.draft_tokens or MOST_DRAFTS) + 1
    step = tokens == 1 or verifying
    if current is not None and step and batch <= current.workload.batch and total <= current.workload.tokens:
        return  # a decode step within the plan: no device work
    padded = tokens > 1 and mask is not None and mask.dim() == 2 and not bool(mask.all())
    if current is None:  # transformers' own loop: its first forward, the whole prompt unless it chunks it
        new_tokens = max(0, cache.expected_tokens - total)
        found = plan_run(cache, Workload(batch, total, new_tokens, None, padded, layer_graphs=True))
        if found.workload.chunk < tokens:
            raise InfinigenError(_chunk_refusal(found, batch, tokens))
        return
    prefill = not step
    context = total if prefill else current.workload.context
    own_loop = not prefill and not cache.driven  # a decode step outside a StepGraph: selection graphs per layer
    seen = Workload(batch, context, max(total - context, 0), tokens if prefill else None, padded, own_loop)
    if not _covers(current.workload, seen, chunk_at_most=False):
        _grown(cache, seen)


def _covers(planned: Workload, work: Workload, chunk_at_most: bool) -> bool:
    """Whether a plan for ``planned`` holds ``work``: no larger batch, context, length or padding; its
    chunk (a prefill forward's tokens) no larger, or, ``chunk_at_most``, the plan's chunk within the one
    asked (``infinigen.decode`` takes the plan's)."""
    if work.batch > planned.batch or work.context > planned.context or work.tokens > planned.tokens:
        return False
    if (work.padded and not planned.padded) or (work.layer_graphs and not planned.layer_graphs):
        return False
    if (work.keeps and not planned.keeps) or (work.rowwise and not planned.rowwise):  # pool blocks of the asked size;
        return False  # the rows' kept copies on the host
    if chunk_at_most:
        return work.prefill_chunk is None or planned.chunk <= work.prefill_chunk
    return work.prefill_chunk is None or work.prefill_chunk <= planned.chunk


def _grown(cache, seen: Workload) -> MemoryPlan:
    """The plan of the run as it has grown (the larger of the plan's sizes and ``seen``'s, decoding room
    for an eighth more tokens), with the settings that run: it replaces the plan where it fits without
    giving up anything but the prefill's own choices; else the forward is refused in one line."""
    was = cache.memory_plan.workload
    context = max(was.context, seen.context)
    tokens = max(was.tokens, seen.tokens)
    if seen.tokens > was.tokens:
        tokens += max(64, tokens // 8)  # planned again once per eighth, not at every step
    chunk = max(was.chunk, seen.chunk) if context > max(was.chunk, seen.chunk) else None
    padded, layer_graphs = was.padded or seen.padded, was.layer_graphs or seen.layer_graphs
    batch, rowwise = max(was.batch, seen.batch), was.rowwise or seen.rowwise
    work = Workload(batch, context, tokens - context, chunk, padded, layer_graphs, was.keeps, rowwise)
    found = _planned(cache, work, cache.config, cache.memory_plan.budget)
    settings = RuntimeConfig(**plan.cache_settings(found))  # as a cache runs them
    kept = _layer_settings(settings) == _layer_settings(cache.config) and found.workload.prefill_chunk == chunk
    if not (found.fits and kept):
        size = f"{work.batch} x {work.context} tokens (+{work.new_tokens} new)"
        why = plan.refusal(found) if not found.fits else f"it would need: {'; '.join(found.shed) or 'other settings'}"
        raise InfinigenError(
            f"this run grew to {size}, past what its memory plan fits ({why}): generate with "
            "custom_generate=infinigen.decode, which plans the whole run before its prefill, or say the run's "
            "length before the first forward (cache.expect(prompt + new tokens))"
        )
    cache.config = replace(cache.config, **{name: getattr(found.config, name) for name in PREFILL_ONLY})
    cache.memory_plan = found
    return found


def _planned(cache, work: Workload, config: RuntimeConfig, budget: int | None) -> MemoryPlan:
    found = plan.plan(cache.planned, cache.weights_dtype, work, config, budget, ranks=cache.shard.ranks)
    return replace(found, weights_loaded=True)


def _layer_settings(config: RuntimeConfig) -> dict:
    """The settings a cache's layers are made with (all but the prefill's own)."""
    return {f.name: getattr(config, f.name) for f in fields(config) if f.name not in PREFILL_ONLY}


def _chunk_refusal(found: MemoryPlan, batch: int, tokens: int) -> str:
    chunk = found.workload.chunk
    budget = "" if found.budget is None else f" of {plan.gb(found.budget)} GB"
    return (
        f"a prompt forward of {batch} x {tokens} tokens at once does not fit the GPU budget{budget} (the memory "
        f"plan fits this run with the prompt in chunks of {chunk} tokens): generate with "
        f"custom_generate=infinigen.decode, which takes the plan's chunk, or pass prefill_chunk_size={chunk}"
    )


def summary(cache) -> dict | None:
    """What a cache's summary says of its plan: ``plan.summary`` and the prefill chunk it ran with."""
    if cache.memory_plan is None:
        return None
    said = plan.summary(cache.memory_plan)
    if cache.prefill_chunks is not None:
        asked, taken = cache.prefill_chunks
        said |= {"prefill_chunk": taken, "prefill_chunk_asked": asked}
    return said
