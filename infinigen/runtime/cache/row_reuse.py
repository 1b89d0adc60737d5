"""Row reuse's decisions for a cache (``InfinigenCache`` takes them from this mixin): the GPU budget auto
reuse plans within, and whether a layer's decode fetches keep rows on the GPU (``memory.reuse``)."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from infinigen.runtime.memory import plan, reuse

if TYPE_CHECKING:
    from infinigen.runtime.cache.layers import OffloadedLayer


class RowReuse:
    def measure_reuse_room(self) -> None:
        """At the first prefill (never inside a captured step): the GPU budget auto reuse plans within
        (``RuntimeConfig.gpu_memory_gb``, else the device's free memory then). On the CPU no bytes are
        saved, so auto reuses rows only to attend rows of earlier steps (the GPU's selection, the same
        rows attended)."""
        if self.reuse_auto and self.gpu_budget is None:
            self.gpu_budget = plan.budget_bytes(self.config.gpu_memory_gb, self.device)
            if self.gpu_budget is None:
                self.resident_extra = self.config.resident_extra_or_default
                self.reuse = reuse.decide(0, None, self.resident_extra)
                self.reuse_auto = False

    def reuses(self, layer: OffloadedLayer) -> bool:
        """Whether ``layer``'s decode fetches keep rows on the GPU. Auto decides at the first decode
        fetch and again whenever a pool has grown, from host arithmetic alone (it may run while a step
        is captured): with as many rows of earlier steps as fit, in 16 bits, else 8 (``reuse.fallback_settings``),
        else without them, else off. Where the rows kept no longer fit, every layer drops them and goes on."""
        if self.reuse_auto and layer.capacity > self.reuse_capacity:
            batch, kv_heads = layer.valid.shape[:2]
            sizes = (layer.head_dim, layer.dtype.itemsize, layer.capacity, self.layer_budgets, self.config.min_tokens)
            planned = plan.resident_room(
                self.planned, layer.dtype, batch, layer.capacity, self.config, self.gpu_budget, ranks=self.shard.ranks
            )
            room = reuse.room_from(planned, self.config.reuse_gpu_gb)
            need = partial(reuse.resident_bytes, batch, kv_heads, *sizes)
            decision, extra, bits = reuse.decide_extra(need, room, self.config)
            if self.reuse.on and (not decision.on or extra < self.resident_extra or bits != self.resident_bits):
                for other in self.offloaded:
                    other.resident = None  # a step's rows in flight stay referenced by its ``Fetched``
                decision = reuse.Decision(decision.on, f"{decision.reason}, from {layer.capacity} tokens on")
            self.reuse, self.reuse_auto, self.reuse_capacity = decision, decision.on, layer.capacity
            self.resident_extra, self.resident_bits = extra, bits
        return self.reuse is not None and self.reuse.on

    def reuse_from_plan(self) -> None:
        """Where the memory plan made auto reuse's choice (its settings: on or off, the rows kept), the
        summary says so rather than "asked"."""
        found = self.memory_plan
        if self.reuse is None or found is None or found.budget is None or found.config.reuse_rows != "auto":
            return
        self.reuse = reuse.Decision(self.reuse.on, f"auto: the memory plan's, within {plan.gb(found.budget)} GB")
