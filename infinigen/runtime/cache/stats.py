"""Counters kept while decoding. GPU-side values stay on the GPU until ``summary`` (no per-step sync).

A fetch's values wait in a short list (at most ``CHUNK`` steps: no device work per step); each full
list is reduced on the device, in a few kernels, into its total of the rows moved and, per
step, the shares of its cached tokens the step selected (what the budget buys), moved over the bus
and attended (with row reuse, fewer move than are selected, and rows of earlier steps may be
attended besides). The summary reports their means and the selection's exact 95th percentile,
which need every step's value: 8 bytes per step, layer and share, kept instead of a histogram so
that the percentile stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from infinigen.runtime.cache import planning
from infinigen.runtime.kernels import int8_rows
from infinigen.runtime.selection.policies import row_bits

CHUNK = 256  # fetches whose values wait on the host before they are reduced
Value = torch.Tensor | int  # per batch row (B,) on the compute device, or one int for every row


@dataclass
class LayerStats:
    written_rows: int = 0  # (token, KV head, batch row) rows stored to the CPU pool
    evicted_tokens: int = 0  # tokens (summed over batch rows) overwritten in this layer's full pool
    kv_heads: int = 0
    batch: int = 0
    # (moved, selected, attended, cached, step)
    pending: list[tuple[Value, Value, Value, Value, bool]] = field(default_factory=list)
    # rows per head moved, summed over each reduced chunk's fetches and batch rows (float64); the chunks'
    # values stay where they were reduced (the CPU for a chunk of ints alone) until the summary reads them
    moved: list[torch.Tensor] = field(default_factory=list)
    fractions: list[torch.Tensor] = field(default_factory=list)  # per reduced chunk: (steps,) float64, selected
    moved_fractions: list[torch.Tensor] = field(default_factory=list)  # the same for the rows moved
    attended_fractions: list[torch.Tensor] = field(default_factory=list)  # and for the rows attended

    def record(
        self,
        moved: Value,
        cached: Value,
        batch: int,
        kv_heads: int,
        selected: Value | None = None,
        attended: Value | None = None,
        step: bool = True,
    ) -> None:
        """One fetch: ``moved`` rows per (batch row, head) out of ``cached`` tokens per batch row, each
        (B,) or one int for all rows; with row reuse, where some rows were already on the GPU,
        ``selected``: the rows of the step's selection, ``attended``: those and any rows of earlier
        steps attended with them (None: the moved ones, the selected ones). ``step``: False for a
        multi-token step's fetch (a prefill chunk re-reads every cached row): its bytes count, but
        the fractions are those of decode steps. No host sync; device work once per CHUNK fetches."""
        self.batch, self.kv_heads = batch, kv_heads
        selected = moved if selected is None else selected
        self.pending.append((moved, selected, selected if attended is None else attended, cached, step))
        if len(self.pending) == CHUNK:
            self._reduce()

    def _reduce(self) -> None:
        """Fold the pending fetches into the running total and the per-step fractions."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        # every value on one device: a step's ints (e.g. a fixed count) beside another's (B,) tensors
        tensors = (value for fetch in pending for value in fetch[:4] if isinstance(value, torch.Tensor))
        device = next(tensors, torch.empty(0)).device  # a chunk of ints alone: the CPU
        self.moved.append(_per_step(tuple(fetch[0] for fetch in pending), self.batch, device).sum())
        # the decode steps' values again, by themselves (indexing the values above by a host list of
        # steps would copy that list from pageable memory: a wait for the device)
        steps = [fetch for fetch in pending if fetch[4]]
        if steps:
            moved, selected, attended, cached = (
                _per_step(values, self.batch, device) for values in list(zip(*steps, strict=True))[:4]
            )
            cached = cached.clamp(min=1)
            # a bulk fetch also moves a padded row's padding slots: it still fetched all of the row's KV
            for rows, kept in (
                (selected, self.fractions),
                (moved, self.moved_fractions),
                (attended, self.attended_fractions),
            ):
                kept.append((rows / cached).clamp(max=1).mean(dim=1))

    def fetched_total(self) -> int:
        self._reduce()
        return round(sum(float(total) for total in self.moved) * self.kv_heads)

    def moved_fraction_mean(self) -> float:
        """The mean share of its cached tokens a decode step moved (below the share selected where
        rows stay on the GPU between steps: row reuse)."""
        self._reduce()
        return _mean(self.moved_fractions)

    def attended_fraction_mean(self) -> float:
        """The mean share of its cached tokens a decode step attended (above the share selected where
        rows of earlier steps are kept: ``resident_extra``)."""
        self._reduce()
        return _mean(self.attended_fractions)

    def fraction_mean_p95(self) -> tuple[float, float]:
        self._reduce()
        if not self.fractions:
            return 0.0, 0.0
        fractions = _joined(self.fractions)
        return float(fractions.mean()), float(fractions.quantile(0.95))


def _joined(chunks: list[torch.Tensor]) -> torch.Tensor:
    """The reduced chunks' per-step values, on the CPU (a summary's read)."""
    return torch.cat([chunk.cpu() for chunk in chunks])


def _mean(chunks: list[torch.Tensor]) -> float:
    return float(_joined(chunks).mean()) if chunks else 0.0


def _per_step(values: tuple[Value, ...], batch: int, device: torch.device) -> torch.Tensor:
    """(steps, B) float64 on ``device``: each step's (B,) tensor, or its int for every row. The ints
    move in one copy, from pinned memory on CUDA (a pageable copy would wait for the device); each
    row is then a view, and one stack gathers them."""
    tensors = [value for value in values if isinstance(value, torch.Tensor)]
    numbers = [float(value) for value in values if not isinstance(value, torch.Tensor)]
    on_device = iter(())
    if numbers:
        host = torch.tensor(numbers, dtype=torch.float64, pin_memory=device.type == "cuda")
        on_device = iter(host.to(device, non_blocking=True))
    rows = [value if isinstance(value, torch.Tensor) else next(on_device).expand(batch) for value in values]
    stacked = torch.stack(rows).to(torch.float64)
    if device.type == "cuda":  # made on other streams, maybe: their memory must outlive this stream's read
        for tensor in tensors:
            tensor.record_stream(torch.cuda.current_stream(device))
    return stacked


def bits_moved(codec, kv_bits: int) -> float:
    """Bits a fetch moves per K or V value: a codec's, 8-bit rows' (their scales stay on the device), else 16."""
    if codec is not None:
        return codec.bits_per_value
    return int8_rows.BITS_MOVED if kv_bits == 8 else 16


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
    moved = [layer.stats.moved_fraction_mean() for layer in layers]
    attended = [layer.stats.attended_fraction_mean() for layer in layers]
    return {
        "fraction_fetched": round(sum(means) / len(means), 4) if means else 0.0,
        "fraction_moved": round(sum(moved) / len(moved), 4) if moved else 0.0,
        "fraction_attended": round(sum(attended) / len(attended), 4) if attended else 0.0,
        "per_layer": per_layer,
        "bytes_host_to_device": fetched * row_bytes,
        "bytes_device_to_host": written * row_bytes,
        "evicted_tokens": evicted,
        "prefetch_wait_ms": round(wait_ms, 3),
        "cpu_pool_bytes": pool_bytes,
    }


def cache_summary(cache) -> dict:
    """One cache's run: its settings as they applied and the totals over its offloaded layers."""
    if cache.wait_events or cache.step_wait_events:
        torch.cuda.synchronize(cache.device)
    wait_ms = sum(b.elapsed_time(a) for b, a in cache.wait_events)
    replay_wait_ms = sum(b.elapsed_time(a) for b, a in cache.step_wait_events) if cache.replayed_steps else None
    offloaded = [layer for layer in cache.offloaded if layer.is_initialized]
    row_bytes = offloaded[0].pool.row_bytes if offloaded else 0
    pool_bytes = sum(layer.pool.nbytes for layer in offloaded)
    summary = summarize(offloaded, row_bytes, wait_ms, pool_bytes)
    kv_bits = row_bits(cache.config)
    bits = bits_moved(cache.policy_type.codec, kv_bits)
    summary["fraction_bytes"] = round(summary["fraction_fetched"] * bits / 16, 4)
    summary["last_replay_wait_ms"] = round(replay_wait_ms, 3) if replay_wait_ms is not None else None
    allocation = cache.allocation if cache.policy_type.budgeted else None
    head = {
        "policy": cache.policy_type.name,
        "allocation": allocation,
        "kv_bits": kv_bits if cache.policy_type.offloads and cache.policy_type.plain_rows else None,  # else n/a
        "reuse_rows": None if cache.reuse is None else str(cache.reuse),  # e.g. "on (auto: 0.40 GB fits in ...)"
        "resident_extra": cache.resident_extra if cache.policy_type.budgeted else None,  # as it applied at the end
        "resident_bits": cache.resident_bits if cache.reuse is not None and cache.reuse.on else None,
        "memory_plan": planning.summary(cache),  # the plan it ran under, with the prefill chunk taken
    }
    verified = {} if cache.verified is None else {f"exact_{k}": v for k, v in cache.verified.summary().items()}
    return head | summary | {"replayed_steps": cache.replayed_steps, "cached_tokens": cache.reused_tokens} | verified
