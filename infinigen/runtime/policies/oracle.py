"""oracle: each head fetches its exact top-k tokens by the true attention logits (its group's best),
k = the budget's share of the row's cached tokens. An accuracy upper bound for a budget: it reads
every key of the layer to score them, so its speed is not meaningful."""

from __future__ import annotations

import math

import torch

from infinigen.runtime.policies.base import Policy, Selection
from infinigen.runtime.policies.infinigen import first_ranks, group_scores
from infinigen.runtime.speculation import rotated_query


class OraclePolicy(Policy):
    name = "oracle"
    lookahead = False  # selects at its own layer, from the layer's exact attention input

    def select(self, layer, attention_input, rope) -> Selection:
        n, spec, attention = layer.used, layer.runtime.spec, layer.attention
        batch, kv_heads = layer.valid.shape[:2]
        if spec.rope:
            query = rotated_query(attention, spec, attention_input, rope) * spec.head_dim**-0.5
        else:  # OPT scales its query after the projection
            query = (attention.q_proj(attention_input) * attention.scaling).view(batch, spec.n_heads, -1)
        rows = torch.empty(batch, kv_heads, 2, n, spec.head_dim, dtype=layer.dtype, device=layer.device)
        layer.pool.gather(layer.runtime.all_slots(n).expand(batch, kv_heads, n), None, rows)
        scores = group_scores(query, rows[:, :, 0], layer.valid[:, :, :n])
        cached = layer.valid[:, :, :n].sum(dim=-1).amax(dim=1)  # (B,)
        count = (cached * self.config.budget).ceil().to(torch.int32)
        k_max = min(n, math.ceil(self.config.budget * n))
        return Selection(indices=first_ranks(scores.topk(k_max, dim=-1).indices, count, n), count=count)
