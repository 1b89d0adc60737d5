"""Counters kept while decoding. GPU-side values stay on the GPU until ``summary`` (no per-step sync)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LayerStats:
    written_rows: int = 0  # (token, KV head, batch row) rows stored to the CPU pool
    evicted_tokens: int = 0  # tokens (summed over batch rows) overwritten in this layer's full pool
    kv_heads: int = 0
    moved: list[torch.Tensor | int] = field(default_factory=list)  # per step: rows per head moved, (B,) or int
    cached: list[torch.Tensor | int] = field(default_factory=list)  # per step: tokens cached per batch row

    def record(self, moved: torch.Tensor | int, cached: torch.Tensor | int, batch: int, kv_heads: int) -> None:
        """One fetch: ``moved`` rows per (batch row, head) out of ``cached`` tokens per batch row, each
        (B,) or one int for all rows; no device work, no host sync."""
        self.kv_heads = kv_heads
        self.moved.append(moved if isinstance(moved, torch.Tensor) else torch.full((batch,), moved))
        self.cached.append(cached if isinstance(cached, torch.Tensor) else torch.full((batch,), cached))

    def _moved(self) -> torch.Tensor:  # (steps, B), on the host
        return torch.stack([m.cpu() for m in self.moved]).double()

    def fetched_total(self) -> int:
        return int(self._moved().sum()) * self.kv_heads if self.moved else 0

    def fraction_mean_p95(self) -> tuple[float, float]:
        if not self.moved:
            return 0.0, 0.0
        cached = torch.stack([c.cpu() for c in self.cached]).double()  # (steps, B)
        # a bulk fetch also moves a padded row's padding slots: it still fetched all of the row's KV
        fractions = (self._moved() / cached.clamp(min=1)).clamp(max=1).mean(dim=1)
        return float(fractions.mean()), float(fractions.quantile(0.95))


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
