"""h2o: heavy hitters + recent window (H2O, NeurIPS 2023). Each KV head keeps a fixed number of tokens,
the budget's share of the prompt: half the most recent, half those with the largest attention
mass accumulated so far (prefill included). A token pushed out is gone for good. The kept tokens
live in the CPU pool and are fetched like every other policy's."""

from __future__ import annotations

import math

import torch

from infinigen.runtime.kernels.buffers import store_slots
from infinigen.runtime.kernels.top_slots import budget_count, first_ranks
from infinigen.runtime.selection.policies.base import LayerView, Policy, Selection, rows_bound


class H2OPolicy(Policy):
    name = "h2o"
    observes_attention = True
    budgeted = True

    def __init__(self, config) -> None:
        super().__init__(config)
        self.scores: torch.Tensor | None = None  # (B, kv_heads, n) float32: accumulated attention mass
        self.alive: torch.Tensor | None = None  # (B, kv_heads, n) bool: not evicted
        self.keep: torch.Tensor | None = None  # (B,) tokens kept per row, fixed at the first decode step

    @classmethod
    def slot_bytes(cls, config, head_dim: int, itemsize: int, channels: int) -> float:
        return 4 + 1  # float32 score, alive

    def stored(self, layer: LayerView, slots, keys) -> None:
        shape = keys.shape[:3]  # (B, kv_heads, T)
        unseen = torch.zeros(shape, dtype=torch.float32, device=keys.device)
        self.scores = store_slots(self.scores, slots, unseen, layer.capacity)
        self.alive = store_slots(self.alive, slots, unseen == 0, layer.capacity)

    def attended(self, layer: LayerView, slots, mass) -> None:
        if slots is None:
            self.scores[:, :, : mass.shape[-1]] += mass
        else:
            self.scores.scatter_add_(-1, slots, mass)

    def select(self, layer: LayerView, attention_input, rope) -> Selection:
        n, cfg = layer.capacity, self.config  # every slot the buffers have; unused ones are invalid
        valid = layer.valid[:, :, :n]
        if self.keep is None:  # the prompt is cached: fix the budget (at the first, uncaptured, decode step)
            cached = valid.sum(dim=-1).amax(dim=1)  # (B,)
            self.keep = budget_count(cached, cfg.budget, cfg.min_tokens)
        k_max = rows_bound(cfg.budget, n, cfg.min_tokens)  # >= keep
        used = layer.device_used()  # (1,)
        recent = layer.all_slots(n) >= (used - self.keep // 2)[:, None, None]  # and unused: invalid
        candidates = self.alive[:, :, :n] & valid
        priority = self.scores[:, :, :n].masked_fill(recent, math.inf).masked_fill(~candidates, -math.inf)
        ranked = priority.topk(k_max, dim=-1).indices  # (B, kv_heads, k_max): best first
        kept = (layer.all_slots(k_max) < self.keep[:, None, None]).expand_as(ranked)
        self.alive[:, :, :n] = False  # evict all but the kept (one token per step once the budget is reached)
        self.alive.scatter_(-1, ranked, kept)
        return Selection(indices=first_ranks(ranked, self.keep, n), count=self.keep)
