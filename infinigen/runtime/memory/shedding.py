"""The order in which a plan under a GPU budget gives up what the budget cannot hold (``plan.plan``). Decoding
and the prefill never hold their workspaces at once, so when the budget is short each gives up only what it needs:

- decoding: rows of earlier steps (``resident_extra``: as asked, then 1, then 0; with 8-bit rows each
  first kept 16-bit on the GPU, then 8-bit: ``resident_bits``), then row reuse itself, where reuse is
  automatic;
- the prefill: its chunk, 4,096 tokens for a one-shot prefill, then halved down to 256 (a 16th of a
  shorter prompt, at least 32; the earlier chunks' KV then read in blocks of at most the chunk:
  ``prefill_block_tokens``);
- only where neither suffices, dense layers, down to 0 (a speculating policy then selects layer 0 from
  its own input, fetching without overlap: the paper keeps it dense for accuracy), each time with the
  most of the above that then fits;
- then, where ``kv_bits`` is the default, 16-bit rows (8-bit ones keep a scale per row on the GPU);
- only where nothing fits, weights streamed from host memory, the settings moving fewest bytes (``streaming``);
- last, where room is left, a later chunk's fetch of the next layer's KV during this one (``prefill_fetch_ahead``;
  under exact decoding, whose verification is such a chunk, before rows of earlier steps).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import TYPE_CHECKING

from infinigen.runtime.config import RuntimeConfig
from infinigen.runtime.memory import reuse
from infinigen.runtime.selection.policies import row_bits

if TYPE_CHECKING:
    from infinigen.runtime.memory.plan import MemoryPlan, Workload


def fetching_ahead(config: RuntimeConfig, remaining, planned) -> MemoryPlan | None:
    """The first fitting of the ``remaining`` candidates with the next layer's blocks fetched ahead, where that
    fits. Under exact decoding, whose verification reads every row as a chunk does (fetched ahead, at about the
    bus's time; a staged block at a time, up to twice it: BENCHMARKS "A small GPU"), that comes before rows of
    earlier steps (the drafts' speed): the first candidate of the same dense layers and chunk whose fetch fits."""
    if not config.prefill_fetch_ahead:
        return None
    (first, _, work), *_ = remaining
    for settings, reused, workload in remaining if config.exact else remaining[:1]:
        if settings.dense_layers != first.dense_layers or workload.prefill_chunk != work.prefill_chunk:
            continue
        if (ahead := planned(replace(settings, prefill_fetch_ahead=True), reused, workload)).fits:
            return ahead
    return None


@functools.lru_cache(maxsize=256)  # a throughput search plans one context at many batches: the same candidates
def candidates(config: RuntimeConfig, policy, chunks: tuple[int | None, ...], auto_reuse: bool, reuse_on: bool):
    """The settings to try, most asked first (the module's docstring): for each number of dense layers, each
    decoding setting, each prefill chunk (the asked first); (settings, row reuse on, prefill chunk) each."""
    candidates, decoding = [], [(config, False)]
    if reuse_on:
        kept = reuse.fallback_settings(config.resident_extra_or_default, row_bits(config), config.resident_bits)
        if not auto_reuse:  # reuse as asked: only the bits its rows are kept in may change
            kept = [(extra, bits) for extra, bits in kept if extra == kept[0][0]]
        decoding = [(replace(config, resident_extra=extra, resident_bits=bits), True) for extra, bits in kept]
        if auto_reuse:
            decoding.append((replace(config, resident_extra=None), False))
    asked_blocks = config.prefill_block_tokens
    for dense in range(config.dense_layers, -1, -1):
        for settings, reused in decoding:
            for chunk in chunks:
                # a shed chunk reads the earlier chunks' KV in blocks no larger than itself
                blocks = asked_blocks if chunk == chunks[0] else min(asked_blocks, chunk)
                candidates.append((replace(settings, dense_layers=dense, prefill_block_tokens=blocks), reused, chunk))
    return tuple(candidates)


def shed_steps(asked, settings, reused_asked: bool, reused: bool, work: Workload, workload: Workload):
    """What ``settings`` / ``workload`` gave up against what was asked, in the shedding order."""
    if reused and settings.resident_extra_or_default != asked.resident_extra_or_default:
        yield f"rows of earlier steps: resident_extra {settings.resident_extra:g}"
    if reused and settings.resident_bits == 8 and not asked.resident_bits:
        yield "rows kept on the GPU: 8-bit"
    if reused_asked and not reused:
        yield "row reuse off"
    if settings.dense_layers != asked.dense_layers:
        yield f"dense layers: {settings.dense_layers}"
    if workload.prefill_chunk != work.prefill_chunk:
        yield f"prefill chunk: {workload.prefill_chunk} tokens"
    if settings.kv_bits != asked.kv_bits:
        yield "rows: 16-bit (no room for 8-bit rows' scales)"
    if asked.prefill_fetch_ahead and not settings.prefill_fetch_ahead and workload.chunk < workload.context:
        yield "prefill: no layer's blocks fetched ahead"
    if settings.streamed_layers and not asked.streamed_layers:
        yield f"weights: {settings.streamed_layers} decoder layers streamed from host memory"
