"""Counters kept while decoding. GPU-side values stay on the GPU until ``summary`` (no per-step sync)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LayerStats:
    written_rows: int = 0  # (token, KV head, batch row) rows stored to the CPU pool
    evicted_tokens: int = 0  # tokens (summed over batch rows) overwritten in this layer's full pool
    kv_heads: int = 0
    moved: list[torch.Tensor] = field(default_factory=list)  # per step: rows per head moved, (B,)
    attended: list[torch.Tensor] = field(default_factory=list)  # per step: rows per head fetched for attention
    cached: list[torch.Tensor] = field(default_factory=list)  # per step: tokens cached per batch row

    def record(
        self,
        moved: torch.Tensor | int,
        cached: torch.Tensor | int,
        batch: int,
        kv_heads: int,
        attended: torch.Tensor | int | None = None,
    ) -> None:
        """One fetch: ``moved`` rows per (batch row, head) out of ``cached`` tokens per batch row, each
        (B,) or one int for all rows; ``attended``: the rows the step attends, where some were already
        on the GPU (row reuse; None: the moved ones). No device work, no host sync."""

        def per_row(value: torch.Tensor | int) -> torch.Tensor:
            return value if isinstance(value, torch.Tensor) else torch.full((batch,), value)

        self.kv_heads = kv_heads
        self.moved.append(per_row(moved))
        self.attended.append(per_row(moved if attended is None else attended))
        self.cached.append(per_row(cached))

    def fetched_total(self) -> int:
        return round(float(_on_host(self.moved).sum()) * self.kv_heads) if self.moved else 0

    def fraction_mean_p95(self) -> tuple[float, float]:
        if not self.moved:
            return 0.0, 0.0
        cached = _on_host(self.cached)
        # a bulk fetch also moves a padded row's padding slots: it still fetched all of the row's KV
        fractions = (_on_host(self.attended) / cached.clamp(min=1)).clamp(max=1).mean(dim=1)
        return float(fractions.mean()), float(fractions.quantile(0.95))


def _on_host(values: list[torch.Tensor]) -> torch.Tensor:
    """(steps, B) float64 on the host."""
    return torch.stack([v.cpu().double() for v in values])


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
