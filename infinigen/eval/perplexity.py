"""Perplexity of the decoded part of text windows, every policy through the runtime."""

from __future__ import annotations

import math

import torch
from transformers import PreTrainedModel

from infinigen.artifacts import Artifact
from infinigen.eval.decoding import teacher_forced_nll
from infinigen.eval.recall import RecallProbe
from infinigen.runtime import RuntimeConfig, cache_for


def pool_settings(model: PreTrainedModel, tokens: int, batch: int, block_tokens: int = 16) -> dict:
    """``cpu_pool_gb`` (and a block size that divides it) for a pool of ``tokens`` tokens per sequence."""
    from infinigen.architectures import model_spec

    spec = model_spec(model.config)
    tokens -= tokens % block_tokens
    offloaded = spec.n_layers - RuntimeConfig.dense_layers  # offloaded layers under the default placement
    row = 2 * spec.head_dim * model.dtype.itemsize
    return {"cpu_pool_gb": tokens * offloaded * batch * spec.n_kv_heads * row / 2**30, "block_tokens": block_tokens}


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
    **settings,
) -> dict:
    """Perplexity of the decoded part of every window, per policy settings (``RuntimeConfig`` fields).

    ``pool_fraction`` limits the CPU pool to that share of a window's tokens (the paper's 80% pool),
    so the decode evicts by ``settings["eviction"]``. ``recall`` adds the selection recall against
    the exact top-k, per offloaded layer and on average.
    """
    nll, fractions, bytes_fractions, evicted = [], [], [], 0
    probe = RecallProbe() if recall else None
    for start in range(0, ids.shape[0], batch):
        chunk = ids[start : start + batch].to(model.device)
        if pool_fraction is not None:
            settings |= pool_settings(model, int(pool_fraction * ids.shape[1]), chunk.shape[0])
        cache = cache_for(model, artifact, **settings)
        cache.diagnostics.decode_probe = probe
        nll.append(teacher_forced_nll(model, cache, chunk, prefix).cpu())
        summary = cache.summary()
        fractions.append(summary["fraction_fetched"])
        bytes_fractions.append(summary["fraction_bytes"])
        evicted += summary["evicted_tokens"]
    nll = torch.cat(nll)  # (windows, decoded)
    blocks = [float(b.mean().exp()) for b in nll.split(block, dim=1)]
    return {
        **settings,
        "pool_fraction": pool_fraction,
        "evicted_tokens": evicted,
        "perplexity": round(math.exp(float(nll.mean())), 4),
        "fraction_fetched": round(sum(fractions) / len(fractions), 4),
        "fraction_bytes": round(sum(bytes_fractions) / len(bytes_fractions), 4),
        "tokens_scored": nll.numel(),
        "block_perplexity": [round(b, 3) for b in blocks],
    } | ({"recall": probe.mean(), "recall_per_layer": probe.per_layer()} if probe is not None else {})
