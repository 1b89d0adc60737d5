"""infinigen: speculate each layer's important tokens one layer ahead from a partial query and the
GPU-resident partial key cache; fetch only those (InfiniGen, OSDI 2024)."""

from __future__ import annotations

import math

import torch

from infinigen.runtime.kernels.buffers import grown_to, store_slots
from infinigen.runtime.kernels.scoring import (
    fused_group_scores,
    group_scores,
    quantize_rows,
    store_token_codes,
)
from infinigen.runtime.kernels.top_slots import FORCED, CountRule, top_slots
from infinigen.runtime.kernels.triton_support import on_triton
from infinigen.runtime.selection.policies.base import LayerView, Policy, Selection, rows_bound


class InfinigenPolicy(Policy):
    name = "infinigen"
    speculates = True
    budgeted = True

    def __init__(self, config) -> None:
        super().__init__(config)
        # On the compute device: (B, kv_heads, n, r) partial keys, or their codes (scoring.quantize_rows:
        # int8 at partial_key_bits=8, two 4-bit codes a byte at 4) and per-token scale (B, kv_heads, n)
        # in the model's dtype (None at 16 bits).
        self.partial_key_cache: torch.Tensor | None = None
        self.partial_key_scale: torch.Tensor | None = None

    @classmethod
    def slot_bytes(cls, config, head_dim: int, itemsize: int, channels: int) -> float:
        bits = config.partial_key_bits
        return channels * itemsize if bits == 16 else channels * bits / 8 + itemsize  # codes and a scale

    def stored(self, layer: LayerView, slots, keys) -> None:
        if self.partial_key_scale is not None and not isinstance(slots, slice) and on_triton(keys.device):
            # a decode step's token: one kernel projects, quantizes and writes it at its slots (B, kv_heads)
            self.partial_key_cache = grown_to(self.partial_key_cache, layer.capacity, 2)
            self.partial_key_scale = grown_to(self.partial_key_scale, layer.capacity, 2)
            projection = layer.speculator.key_projection
            store_token_codes(keys, projection, slots, self.partial_key_cache, self.partial_key_scale)
            return
        partial = layer.speculator.partial_keys(keys)  # (B, kv_heads, T, r)
        if self.config.partial_key_bits < 16:
            partial, scale = quantize_rows(partial, self.config.partial_key_bits)
            self.partial_key_scale = store_slots(self.partial_key_scale, slots, scale, layer.capacity)
        self.partial_key_cache = store_slots(self.partial_key_cache, slots, partial, layer.capacity)

    def select(self, layer: LayerView, attention_input, rope) -> Selection:
        n, cfg = layer.capacity, self.config  # every slot the buffers have; unused ones are invalid
        k_max = rows_bound(cfg.budget, n, cfg.min_tokens)
        partial_query = layer.speculator.partial_query(attention_input, rope)  # (B, heads, r)
        # the count needs the other tensor-parallel ranks' heads only with a finite alpha (``CountRule``)
        ranks = layer.speculator.shard.group if math.isfinite(cfg.alpha) else None
        indices, count = select_tokens(
            partial_query,
            self.partial_key_cache[:, :, :n],
            layer.valid[:, :, :n],
            k_max,
            CountRule(cfg.budget, cfg.alpha, cfg.min_tokens, ranks),
            key_scale=None if self.partial_key_scale is None else self.partial_key_scale[:, :, :n],
            always=always_fetched(layer, n, cfg.sink_tokens, cfg.recent_tokens, cfg.budget),
        )
        return Selection(indices=indices, count=count)


def always_fetched(layer: LayerView, n: int, sinks: int, recent: int, budget: float) -> torch.Tensor | None:
    """(B, kv_heads, n) bool: each row's first ``sinks`` cached slots (after its left padding) and its
    last ``recent`` slots, at most half the row's budget (a short context keeps speculating most of
    what it fetches); None for neither. Slots follow token order while the pool appends (a full pool
    overwrites slots out of order: its "recent" slots are then the last ones, not the newest)."""
    if sinks == 0 and recent == 0:
        return None
    slots, valid = layer.all_slots(n), layer.valid[:, :, :n]
    window = (valid.sum(dim=-1, keepdim=True) * (budget / 2)).long().clamp(max=recent)  # (B, kv_heads, 1)
    always = slots >= layer.device_used() - window
    if sinks:  # (the default has none: the first cached slot costs two kernels a layer and step)
        first = valid.int().argmax(dim=-1, keepdim=True)  # (B, kv_heads, 1): the first cached slot
        always |= slots < first + sinks
    return always & valid


def select_tokens(
    partial_query: torch.Tensor,  # (B, heads, r)
    partial_keys: torch.Tensor,  # (B, kv_heads, n, r)
    valid: torch.Tensor,  # (B, kv_heads, n) bool
    k_max: int,
    rule: CountRule,
    key_scale: torch.Tensor | None = None,  # (B, kv_heads, n) for quantized partial keys
    always: torch.Tensor | None = None,  # (B, kv_heads, n) bool: slots fetched whatever they score
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculated scores -> (slots (B, kv_heads, k_max) ascending, count (B,) int32): per batch row
    the tokens within alpha of each head's best, averaged over its KV heads, capped by the budget
    share of the row's own cached tokens (``CountRule``); ``always`` slots rank first."""
    if key_scale is not None and on_triton(partial_keys.device):
        scores, tile_max = fused_group_scores(partial_query, partial_keys, valid, key_scale)
    else:
        scores, tile_max = group_scores(partial_query, partial_keys, valid, key_scale), None
    if always is not None:
        scores = scores.masked_fill(always, FORCED)  # tile_max keeps the best speculated score
    return top_slots(scores, rule, k_max, tile_max)
