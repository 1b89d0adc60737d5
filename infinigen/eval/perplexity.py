"""Perplexity of the decoded part of text windows, every policy through the runtime."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from infinigen.artifacts import Artifact
from infinigen.eval.decoding import planned, teacher_forced_nll
from infinigen.eval.recall import RecallProbe
from infinigen.runtime import cache_for
from infinigen.runtime.config import config_from
from infinigen.runtime.memory import plan as memory


def pool_settings(model: PreTrainedModel, settings: dict, tokens: int, batch: int, block_tokens: int = 16) -> dict:
    """``cpu_pool_gb`` (and a block size that divides it) for a pool of ``tokens`` tokens per sequence
    and offloaded layer under ``settings``: rows sized as the policy stores them (compressed or 8-bit
    ones are smaller), over the layers it offloads."""
    from infinigen.architectures import model_spec, sliding_windows
    from infinigen.runtime.memory.pool import row_bytes
    from infinigen.runtime.selection.policies import POLICIES, row_bits

    spec, config = model_spec(model.config), config_from(settings)
    policy = POLICIES[config.policy]
    windows = sliding_windows(model.config)  # sliding-window layers are never offloaded
    offloaded = sum(w is None and i >= config.dense_layers for i, w in enumerate(windows)) if policy.offloads else 0
    tokens -= tokens % block_tokens
    stored = row_bytes(spec.head_dim, model.dtype, policy.codec, row_bits(config))
    nbytes = tokens * offloaded * batch * spec.n_kv_heads * stored
    return {"cpu_pool_gb": (nbytes + 0.5) / 1e9, "block_tokens": block_tokens}  # + half a byte: no rounding down


def perplexity(
    model: PreTrainedModel,
    artifact: Artifact | None,
    ids: torch.Tensor,
    prefix: int,
    *,
    batch: int,
    block: int = 256,
    pool_fraction: float | None = None,
    recall: bool = False,
    on_step: Callable[[], None] = lambda: None,
    **settings,
) -> dict:
    """Perplexity of the decoded part of every window, per policy settings (``RuntimeConfig`` fields).

    ``pool_fraction`` limits the CPU pool to that share of a window's tokens (the paper's 80% pool),
    so the decode evicts by ``settings["eviction"]``. ``recall`` adds the selection recall against
    the exact top-k, per offloaded layer and on average. ``on_step`` hears each decode step.
    """
    nll, evicted = [], 0
    shares = ("fraction_fetched", "fraction_moved", "fraction_attended", "fraction_bytes")
    fractions: dict[str, list[float]] = {name: [] for name in shares}  # each cache's (window batch's)
    applied = None  # resident_extra as it applied (the last cache's)
    probe = RecallProbe() if recall else None
    for start in range(0, ids.shape[0], batch):
        rows = ids[start : start + batch].to(model.device)
        if pool_fraction is not None:
            settings |= pool_settings(model, settings, int(pool_fraction * ids.shape[1]), rows.shape[0])
        found = planned(model, settings, rows.shape[0], prefix, ids.shape[1] - 1 - prefix)
        if why := memory.why_not(found):  # the sweep goes on: this row says why it did not run
            return {**settings, "memory_plan": memory.summary(found), "error": why}
        cache = cache_for(model, artifact, plan=found)
        cache.diagnostics.decode_probe = probe
        nll.append(teacher_forced_nll(model, cache, rows, prefix, on_step=on_step, chunk=found.workload.chunk).cpu())
        summary = cache.summary()
        for name, values in fractions.items():
            values.append(summary[name])
        evicted += summary["evicted_tokens"]
        applied, bits = summary["resident_extra"], summary["kv_bits"]
    nll = torch.cat(nll)  # (windows, decoded)
    blocks = [float(b.mean().exp()) for b in nll.split(block, dim=1)]
    return {
        **settings,
        "pool_fraction": pool_fraction,
        "batch": batch,  # windows decoded together
        "evicted_tokens": evicted,
        "resident_extra_applied": applied,
        "kv_bits_applied": bits,  # the row format that ran (kv_bits: as asked; None where no row is offloaded)
        "perplexity": round(math.exp(float(nll.mean())), 4),
        **{name: round(sum(values) / len(values), 4) for name, values in fractions.items()},
        "tokens_scored": nll.numel(),
        "memory_plan": memory.summary(found),
        "block_perplexity": [round(b, 3) for b in blocks],
    } | ({"recall": probe.mean(), "recall_per_layer": probe.per_layer()} if probe is not None else {})
