"""Per-layer fetch statistics: running totals and per-step fractions, the summary's values as
computed from every step's tensors (the former way)."""

from __future__ import annotations

import pytest
import torch

from infinigen.runtime.cache.stats import CHUNK, LayerStats


def test_a_small_run_by_hand(device):
    """Without row reuse every selected row moves and is attended; with it the three shares differ
    (selected: what the budget buys, moved: over the bus, attended: with rows of earlier steps), and
    each defaults to the one before it. A multi-token step's rows count as bytes, not as a step."""
    stats = LayerStats()
    stats.record(2, 10, batch=2, kv_heads=4)  # 2 of 10 tokens in both rows: 0.2
    stats.record(torch.tensor([4, 6], device=device), torch.tensor([10, 20], device=device), 2, 4)  # 0.4, 0.3
    assert stats.fetched_total() == (2 + 2 + 4 + 6) * 4
    mean, p95 = stats.fraction_mean_p95()
    assert mean == pytest.approx((0.2 + 0.35) / 2) and p95 == pytest.approx(0.2 + 0.95 * 0.15)
    assert stats.moved_fraction_mean() == pytest.approx(mean)  # every selected row moved
    assert stats.attended_fraction_mean() == pytest.approx(mean)  # and was attended, no other
    stats.record(1, 10, batch=2, kv_heads=4, selected=2, attended=3)  # row reuse: 1 moved, 2 selected, 3 attended
    assert stats.fetched_total() == (2 + 2 + 4 + 6 + 1 + 1) * 4
    assert stats.moved_fraction_mean() == pytest.approx((0.2 + 0.35 + 0.1) / 3)
    mean, p95 = stats.fraction_mean_p95()
    assert mean == pytest.approx((0.2 + 0.35 + 0.2) / 3) and p95 == pytest.approx(0.2 + 0.9 * 0.15)
    assert stats.attended_fraction_mean() == pytest.approx((0.2 + 0.35 + 0.3) / 3)
    stats.record(1, 10, batch=2, kv_heads=4, selected=4)  # attended: the selection
    stats.record(1, 10, batch=2, kv_heads=4, attended=5)  # selected: the moved rows
    assert stats.moved_fraction_mean() == pytest.approx((0.2 + 0.35 + 0.1 + 0.1 + 0.1) / 5)
    assert stats.fraction_mean_p95()[0] == pytest.approx((0.2 + 0.35 + 0.2 + 0.4 + 0.1) / 5)
    assert stats.attended_fraction_mean() == pytest.approx((0.2 + 0.35 + 0.3 + 0.4 + 0.5) / 5)
    stats.record(10, 10, batch=2, kv_heads=4, step=False)  # a prefill chunk's bulk fetch
    assert stats.fetched_total() == (2 + 2 + 4 + 6 + 1 + 1 + 1 + 1 + 1 + 1 + 10 + 10) * 4
    assert stats.moved_fraction_mean() == pytest.approx((0.2 + 0.35 + 0.1 + 0.1 + 0.1) / 5)
    assert stats.fraction_mean_p95()[0] == pytest.approx((0.2 + 0.35 + 0.2 + 0.4 + 0.1) / 5)


def former_summary(records: list[tuple], batch: int, kv_heads: int) -> dict[str, float]:
    """Every step's values kept and stacked on the host at the end, as the runtime did before; records
    (moved, cached, selected, attended), None for the default (selected: moved, attended: selected)."""

    def stacked(values) -> torch.Tensor:  # (steps, B) float64
        rows = [v if isinstance(v, torch.Tensor) else torch.full((batch,), v) for v in values]
        return torch.stack([row.cpu().double() for row in rows])

    selected_values = [r[0] if r[2] is None else r[2] for r in records]
    moved = stacked(r[0] for r in records)
    selected = stacked(selected_values)
    attended = stacked(s if r[3] is None else r[3] for r, s in zip(records, selected_values, strict=True))
    cached = stacked(r[1] for r in records).clamp(min=1)

    def fractions(rows: torch.Tensor) -> torch.Tensor:  # (steps,): the share of the cached tokens
        return (rows / cached).clamp(max=1).mean(dim=1)

    chosen = fractions(selected)
    return {
        "total": round(float(moved.sum()) * kv_heads),
        "mean": float(chosen.mean()),
        "p95": float(chosen.quantile(0.95)),
        "moved": float(fractions(moved).mean()),
        "attended": float(fractions(attended).mean()),
    }


def test_a_long_mixed_run_summarizes_as_every_step_kept(device):
    """Chunked reduction of ints, (B,) tensors and defaults mixed gives every share's mean, the
    selection's exact 95th percentile and the bytes, as if every step's values were kept."""
    generator = torch.Generator().manual_seed(0)
    batch, kv_heads = 3, 2

    def value(high: int, dtype=torch.int32):
        if torch.rand((), generator=generator) < 0.4:
            return int(torch.randint(0, high, (), generator=generator))
        return torch.randint(0, high, (batch,), generator=generator).to(device, dtype)

    def maybe(high: int):
        return None if torch.rand((), generator=generator) < 0.5 else value(high)

    records = []
    for _ in range(2 * CHUNK + 37):
        cached = value(400, torch.int64)
        moved = value(100) if torch.rand((), generator=generator) < 0.8 else torch.rand(batch).double().to(device) * 9
        records.append((moved, cached, maybe(120), maybe(240)))
    stats = LayerStats()
    for moved, cached, selected, attended in records:
        stats.record(moved, cached, batch, kv_heads, selected=selected, attended=attended)
    assert len(stats.pending) < CHUNK  # reduced as they came
    former = former_summary(records, batch, kv_heads)
    assert stats.fetched_total() == former["total"]
    assert stats.fraction_mean_p95() == pytest.approx((former["mean"], former["p95"]), rel=1e-12)
    assert stats.moved_fraction_mean() == pytest.approx(former["moved"], rel=1e-12)
    assert stats.attended_fraction_mean() == pytest.approx(former["attended"], rel=1e-12)
    assert len({former["mean"], former["moved"], former["attended"]}) == 3  # the three shares differ here
