"""Selection recall: how many of the tokens a policy fetched are the exact top-k by the true logits.

Attached to a cache as its ``diagnostics.decode_probe``; at each decode attention of an offloaded layer it
scores every cached key with the layer's true query (the oracle's rule: a KV head's token scores
by its query group's best logit) and counts the fetched tokens that are among the k best, k being
the number the policy fetched for that head. Fetched means the step's selection: rows of earlier
steps attended beside it (``resident_extra``) are not scored. Accuracy diagnostics only: it reads
the whole pool.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from infinigen.runtime.cache.layers import OffloadedLayer
from infinigen.runtime.kernels import int8_rows
from infinigen.runtime.kernels.scoring import group_scores


class RecallProbe:
    def __init__(self) -> None:
        self.hits: dict[int, float] = defaultdict(float)
        self.selected: dict[int, float] = defaultdict(float)

    def __call__(self, layer: OffloadedLayer, query: torch.Tensor) -> None:
        """query (B, H, 1, d): the layer's true query at this step (the current token is already stored)."""
        if layer.policy.codec is not None:  # compressed rows: every token is fetched, nothing to recall
            return
        fetched = layer.attended_fetch
        batch, kv_heads = layer.valid.shape[:2]
        scores = true_scores(layer, query[:, :, 0], layer.used - 1)  # the slots the selection chose from
        # the step's selection among the positions attended (with row reuse these hold rows of earlier steps too)
        selection, mask = layer.last_selection
        picked = torch.zeros(batch, kv_heads, layer.capacity + 1, dtype=torch.bool, device=mask.device)
        indices = layer.cache.selected_slots(layer, selection)
        picked.scatter_(-1, indices, mask[:, :, : indices.shape[-1]])
        chosen = fetched.valid[:, :, :-1] & picked.gather(-1, fetched.indices)  # (B, kv_heads, K)
        k = chosen.sum(dim=-1)  # (B, kv_heads)
        k_max = int(k.max())
        if k_max == 0:
            return
        ranked = scores.topk(k_max, dim=-1).indices
        best = scores.new_zeros(batch, kv_heads, layer.capacity, dtype=torch.bool)  # fetched slots < capacity
        best.scatter_(-1, ranked, torch.arange(k_max, device=k.device) < k[..., None])
        self.hits[layer.index] += float((best.gather(-1, fetched.indices) & chosen).sum())
        self.selected[layer.index] += float(k.sum())

    def per_layer(self) -> dict[int, float]:
        return {i: round(self.hits[i] / self.selected[i], 4) for i in sorted(self.selected) if self.selected[i]}

    def mean(self) -> float | None:
        values = list(self.per_layer().values())
        return round(sum(values) / len(values), 4) if values else None


def true_scores(layer: OffloadedLayer, query: torch.Tensor, n: int) -> torch.Tensor:
    """query (B, H, d) over the keys of slots 0 .. n-1 -> (B, kv_heads, n), read block by block from the
    pool: fixed-size pieces (a whole-pool gather of a size that grows every step fragments the
    host heap: 20 GB of resident memory over a 4-window CPU evaluation)."""
    parts = []
    for index, block in enumerate(layer.pool.blocks):
        start = index * layer.pool.block_tokens
        if start >= n:
            break
        keys = block[:, :, : n - start, 0]  # (B, kv_heads, t, d): the K plane (8-bit rows: its codes)
        if layer.pool.kv_bits == 8:
            scales = layer.pool.scales[:, :, start : start + keys.shape[2], 0]
            keys = int8_rows.decode(keys, scales, query.dtype, layer.pool.factors[:, :, None, 0])
        keys = keys.to(query.device, query.dtype)
        parts.append(group_scores(query, keys, layer.valid[:, :, start : start + keys.shape[2]]))
    return torch.cat(parts, dim=-1)
