"""oracle: each head fetches its exact top-k tokens by the true attention logits (its group's best),
k = the budget's share of the row's cached tokens. An accuracy upper bound for a budget: it keeps a
copy of every key on the compute device to score them, so its speed and memory are not meaningful."""

from __future__ import annotations

import torch

from infinigen.runtime.kernels.buffers import store_slots
from infinigen.runtime.kernels.scoring import group_scores
from infinigen.runtime.kernels.top_slots import budget_count, first_ranks
from infinigen.runtime.selection.policies.base import LayerView, Policy, Selection, rows_bound
from infinigen.runtime.selection.speculation import exact_query


class OraclePolicy(Policy):
    name = "oracle"
    budgeted = True
    lookahead = False  # selects at its own layer, from the layer's exact attention input

    def __init__(self, config) -> None:
        super().__init__(config)
        self.keys: torch.Tensor | None = None  # (B, kv_heads, n, d): every cached key

    @classmethod
    def slot_bytes(cls, config, head_dim: int, itemsize: int, channels: int) -> float:
        return head_dim * itemsize  # every key

    def stored(self, layer: LayerView, slots, keys) -> None:
        self.keys = store_slots(self.keys, slots, keys, layer.capacity)

    def select(self, layer: LayerView, attention_input, rope) -> Selection:
        n = layer.capacity
        query = exact_query(layer.attention, layer.spec, attention_input, rope)  # (B, heads, d)
        scores = group_scores(query, self.keys[:, :, :n], layer.valid[:, :, :n])
        cached = layer.valid[:, :, :n].sum(dim=-1).amax(dim=1)  # (B,)
        count = budget_count(cached, self.config.budget, self.config.min_tokens)
        k_max = rows_bound(self.config.budget, n, self.config.min_tokens)
        return Selection(indices=first_ranks(scores.topk(k_max, dim=-1).indices, count, n), count=count)
