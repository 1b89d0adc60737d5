"""Per-layer fetch statistics: running totals and per-step fractions, the summary's values as
computed from every step's tensors (the former way)."""

from __future__ import annotations

import pytest
import torch

from infinigen.runtime.stats import CHUNK, LayerStats


def test_a_small_run_by_hand(device):
    stats = LayerStats()
    stats.record(2, 10, batch=2, kv_heads=4)  # 2 of 10 tokens in both rows: 0.2
    stats.record(torch.tensor([4, 6], device=device), torch.tensor([10, 20], device=device), 2, 4)  # 0.4, 0.3
    assert stats.fetched_total() == (2 + 2 + 4 + 6) * 4
    mean, p95 = stats.fraction_mean_p95()
    assert mean == pytest.approx((0.2 + 0.35) / 2) and p95 == pytest.approx(0.2 + 0.95 * 0.15)
    assert stats.moved_fraction_mean() == pytest.approx(mean)  # every attended row moved
    stats.record(1, 10, batch=2, kv_heads=4, attended=3)  # row reuse: 3 attended, 1 of them moved
    assert stats.moved_fraction_mean() == pytest.approx((0.2 + 0.35 + 0.1) / 3)
    assert stats.fraction_mean_p95()[0] == pytest.approx((0.2 + 0.35 + 0.3) / 3)


def former_summary(records: list[tuple], batch: int, kv_heads: int) -> tuple[int, float, float]:
    """Every step's values kept and stacked on the host at the end, as the runtime did before."""

    def stacked(values) -> torch.Tensor:  # (steps, B) float64
        rows = [v if isinstance(v, torch.Tensor) else torch.full((batch,), v) for v in values]
        return torch.stack([row.cpu().double() for row in rows])

    moved = stacked(r[0] for r in records)
    attended = stacked(r[0] if r[2] is None else r[2] for r in records)
    cached = stacked(r[1] for r in records)
    fractions = (attended / cached.clamp(min=1)).clamp(max=1).mean(dim=1)
    return round(float(moved.sum()) * kv_heads), float(fractions.mean()), float(fractions.quantile(0.95))


def test_a_long_mixed_run_summarizes_as_every_step_kept(device):
    generator = torch.Generator().manual_seed(0)
    batch, kv_heads = 3, 2

    def value(high: int, dtype=torch.int32):
        if torch.rand((), generator=generator) < 0.4:
            return int(torch.randint(0, high, (), generator=generator))
        return torch.randint(0, high, (batch,), generator=generator).to(device, dtype)

    records = []
    for _ in range(2 * CHUNK + 37):
        cached = value(400, torch.int64)
        moved = value(100) if torch.rand((), generator=generator) < 0.8 else torch.rand(batch).double().to(device) * 9
        attended = None if torch.rand((), generator=generator) < 0.5 else value(120)
        records.append((moved, cached, attended))
    stats = LayerStats()
    for moved, cached, attended in records:
        stats.record(moved, cached, batch, kv_heads, attended=attended)
    assert len(stats.pending) < CHUNK  # reduced as they came
    total, mean, p95 = former_summary(records, batch, kv_heads)
    assert stats.fetched_total() == total
    assert stats.fraction_mean_p95() == pytest.approx((mean, p95), rel=1e-12)
