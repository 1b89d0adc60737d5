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
        n, cfg = layer.used, self.config
        k_max = min(n, max(cfg.min_tokens, math.ceil(cfg.budget * n)))  # static bound for every row
        partial_query = layer.speculator.partial_query(attention_input, rope)  # (B, heads, r)
        indices, count = select_tokens(
            partial_query,
            layer.partial_keys[:, :, :n],
            layer.valid[:, :, :n],
            k_max,
            cfg.budget,
            cfg.alpha,
            cfg.min_tokens,
        )
        return Selection(indices=indices, count=count)


def select_tokens(
    partial_query: torch.Tensor,  # (B, heads, r)
    partial_keys: torch.Tensor,  # (B, kv_heads, n, r)
    valid: torch.Tensor,  # (B, kv_heads, n) bool
    k_max: int,
    budget: float,
    alpha: float,
    min_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculated scores -> (slots (B, kv_heads, k_max) ascending, count (B,) int32)."""
    batch, kv_heads, n, _ = partial_keys.shape
    grouped = partial_query.view(batch, kv_heads, -1, partial_query.shape[-1])
    # Each KV head scores a token by the best logit of its query group.
    scores = torch.einsum("bkgr,bktr->bkgt", grouped, partial_keys).amax(dim=2).float()
    scores = scores.masked_fill(~valid, -math.inf)
    top = scores.topk(k_max, dim=-1)
    # Per batch row: tokens within alpha of each head's best, averaged over its KV heads, then
    # capped by the budget share of the row's own cached tokens (rows never influence each other).
    above = (scores > top.values[..., :1] - alpha).sum(dim=-1).float().mean(dim=1)  # (B,)
    cached = valid.sum(dim=-1).amax(dim=1)  # (B,)
    cap = (cached * budget).ceil().clamp(min=min_tokens).minimum(cached)
    count = above.round().maximum(cached.clamp(max=min_tokens)).minimum(cap).to(torch.int32)
    rank = torch.arange(k_max, device=scores.device)
    kept = torch.where(rank < count[:, None, None], top.indices, n)  # slot n sorts last: not fetched
    return kept.sort(dim=-1).values.clamp(max=n - 1), count
