"""Counters kept while decoding. GPU-side values stay on the GPU until ``summary`` (no per-step sync)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LayerStats:
    written_rows: int = 0  # (token, KV head, batch row) rows stored to the CPU pool
    evicted_tokens: int = 0  # tokens (summed over batch rows) overwritten in this layer's full pool
    candidate_rows: int = 0  # rows cached when a fetch was decided (the denominator of "fraction fetched")
    fetched_rows: list[torch.Tensor] = field(default_factory=list)  # per decode step, on the device
    fractions: list[torch.Tensor] = field(default_factory=list)  # per decode step: fetched / cached

    def fetched_total(self) -> int:
        return int(torch.stack(self.fetched_rows).sum()) if self.fetched_rows else 0

    def fraction_mean_p95(self) -> tuple[float, float]:
        if not self.fractions:
            return 0.0, 0.0
        values = torch.stack(self.fractions).float().cpu()
        return float(values.mean()), float(values.quantile(0.95))


def summarize(layers, row_bytes: int, wait_ms: float, pool_bytes: int) -> dict:
    """Totals over the offloaded layers of one cache."""
    per_layer = {}
    fetched = written = evicted = 0
    for layer in layers:
        mean, p95 = layer.stats.fraction_mean_p95()
        per_layer[layer.index] = {"fraction_mean": round(mean, 4), "fraction_p95": round(p95, 4)}
        fetched += layer.stats.fetched_total()
        written += layer.stats.written_rows
        evicted = max(evicted, layer.stats.evicted_tokens)  # the same in every offloaded layer
    means = [v["fraction_mean"] for v in per_layer.values()]
    return {
        "fraction_fetched": round(sum(means) / len(means), 4) if means else 0.0,
        "per_layer": per_layer,
        "bytes_host_to_device": fetched * row_bytes,
        "bytes_device_to_host": written * row_bytes,
        "evicted_tokens": evicted,
        "prefetch_wait_ms": round(wait_ms, 3),
        "cpu_pool_bytes": pool_bytes,
    }
