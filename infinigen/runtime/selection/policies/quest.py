"""quest: query-aware page selection (Quest, ICML 2024). Keys are grouped in pages of 16 slots; the
compute device keeps each page's per-channel max and min key, so ``q . k`` for any token of a page
is at most ``sum(max(q * max_key, q * min_key))``. Each step fetches the pages with the highest
bound, as many as the budget allows, selecting at the layer itself with its true query."""

from __future__ import annotations

import math

import torch

from infinigen.runtime.kernels.buffers import grown_to
from infinigen.runtime.kernels.top_slots import first_ranks
from infinigen.runtime.selection.policies.base import LayerView, Policy, Selection
from infinigen.runtime.selection.speculation import exact_query

PAGE = 16


class QuestPolicy(Policy):
    name = "quest"
    budgeted = True
    paged = True  # a padded row's pages hold other tokens than alone: rows batch only with their own length
    lookahead = False  # query-aware: needs this layer's own query

    def __init__(self, config) -> None:
        super().__init__(config)
        # (B, kv_heads, pages, 2, d): per page, the max of the keys and the max of the negated keys
        # (= -min): both bounds update with one max-reduction.
        self.page_bounds: torch.Tensor | None = None

    @classmethod
    def slot_bytes(cls, config, head_dim: int, itemsize: int, channels: int) -> float:
        return 2 * head_dim * itemsize / PAGE  # a page's two bounds

    def stored(self, layer: LayerView, slots, keys) -> None:
        signed = torch.stack([keys, -keys], dim=3)  # (B, kv_heads, T, 2, d)
        if self.page_bounds is None:
            self.page_bounds = keys.new_full((*keys.shape[:2], 0, *signed.shape[3:]), -math.inf)
        self.page_bounds = grown_to(self.page_bounds, math.ceil(layer.capacity / PAGE), 2, fill=-math.inf)
        if isinstance(slots, torch.Tensor):  # a decode token's slots (B, kv_heads): widen their pages' bounds
            index = (slots // PAGE).view(*slots.shape, 1, 1, 1).expand_as(signed)
            self.page_bounds.scatter_reduce_(2, index, signed, "amax")
            return
        first, last = slots.start // PAGE, (slots.stop - 1) // PAGE + 1
        span = signed.new_full((*signed.shape[:2], (last - first) * PAGE, *signed.shape[3:]), -math.inf)
        span[:, :, slots.start - first * PAGE : slots.stop - first * PAGE] = signed
        pages = self.page_bounds[:, :, first:last]
        torch.maximum(pages, span.unflatten(2, (last - first, PAGE)).amax(dim=3), out=pages)

    def upper_bounds(self, query: torch.Tensor, pages: int) -> torch.Tensor:
        """query (B, heads, d) -> (B, kv_heads, pages): per KV head, the largest logit any token of a
        page can give any query of the head's group."""
        bounds = self.page_bounds[:, :, :pages]
        grouped = query.view(*bounds.shape[:2], -1, query.shape[-1])  # (B, kv_heads, G, d)
        signed = torch.stack([grouped.clamp(min=0), -grouped.clamp(max=0)], dim=3)  # (B, kv_heads, G, 2, d)
        return torch.einsum("bkgsd,bkpsd->bkgp", signed, bounds).amax(dim=2).float()

    def select(self, layer: LayerView, attention_input, rope) -> Selection:
        capacity = layer.capacity
        pages = math.ceil(capacity / PAGE)
        k_pages = min(pages, max(1, math.ceil(self.config.budget * capacity / PAGE)))  # static bound
        query = exact_query(layer.attention, layer.spec, attention_input, rope)  # (B, heads, d)
        filled = grown_to(layer.valid[:, :, :capacity], pages * PAGE, 2, fill=False)  # (B, kv_heads, pages * PAGE)
        empty = ~filled.unflatten(2, (pages, PAGE)).any(dim=-1)  # pages of padding or unused slots only
        cached_pages = (~empty).sum(dim=-1).amax(dim=1)  # (B,)
        page_count = (cached_pages * self.config.budget).ceil().clamp(min=1).to(torch.int32)  # (B,)
        ranked = self.upper_bounds(query, pages).masked_fill(empty, -math.inf).topk(k_pages, dim=-1).indices
        chosen = first_ranks(ranked, page_count, pages)  # (B, kv_heads, k_pages) ascending
        slots = (chosen[..., None] * PAGE + layer.all_slots(PAGE)).flatten(2)
        # a last page past the capacity (blocks not a multiple of a page) repeats the last slot, unattended
        return Selection(indices=slots.clamp(max=capacity - 1), count=page_count * PAGE, valid=slots < capacity)
