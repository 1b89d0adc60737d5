"""infinigen: speculate each layer's important tokens one layer ahead from a partial query and the
GPU-resident partial key cache; fetch only those (InfiniGen, OSDI 2024)."""

from __future__ import annotations

import math

import torch

from infinigen.runtime.policies.base import Policy, Selection


class InfinigenPolicy(Policy):
    name = "infinigen"
    speculates = True

    def select(self, layer, attention_input, rope) -> Selection:
        n = layer.used
        cfg = self.config
        partial_query = layer.speculator.partial_query(attention_input, rope)  # (B, heads, r)
        scores = layer.speculator.scores(partial_query, layer.partial_keys[:, :, :n])  # (B, kv_heads, n)
        scores = scores.float().masked_fill(~layer.valid[:, :, :n], -math.inf)
        k_max = min(n, max(cfg.min_tokens, math.ceil(cfg.budget * n)))  # static bound for every row
        top = scores.topk(k_max, dim=-1)
        # Per batch row: tokens within alpha of each head's best, averaged over its KV heads, then
        # capped by the budget share of the row's own cached tokens (rows never influence each other).
        above = (scores > top.values[..., :1] - cfg.alpha).sum(dim=-1).float().mean(dim=1)  # (B,)
        cached = layer.valid[:, :, :n].sum(dim=-1).amax(dim=1)  # (B,)
        cap = (cached * cfg.budget).ceil().clamp(min=cfg.min_tokens).minimum(cached)
        count = above.round().maximum(cached.clamp(max=cfg.min_tokens)).minimum(cap).to(torch.int32)
        rank = torch.arange(k_max, device=scores.device)
        kept = torch.where(rank < count[:, None, None], top.indices, n)  # slot n sorts last: not fetched
        return Selection(indices=kept.sort(dim=-1).values.clamp_(max=n - 1), count=count)
