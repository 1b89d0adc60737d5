"""How concentrated each KV head's attention is on the calibration text, for adaptive budgets.

For query positions spread over the second half of each calibration sample, a KV head's tokens are
ranked as the runtime's selection ranks them (the best logit of the head's query group), and the
attention mass the first ``ceil(f * cached)`` of them miss is averaged, at each fraction f of
``FRACTIONS``: a curve per layer and KV head that falls to 0 at f = 1.
"""

from __future__ import annotations

import torch

FRACTIONS = tuple(round(2 ** (i / 3 - 8), 6) for i in range(25))  # 1/256 .. 1, three points a doubling
QUERIES = 64  # query positions per sample
MIN_TOKENS = 32  # shorter samples say little about long contexts: they are skipped


@torch.no_grad()
def missed_mass(pairs: list[tuple[torch.Tensor, torch.Tensor]], scaling: float) -> torch.Tensor | None:
    """pairs: per calibration sample, one layer's queries (heads, T, d) and keys (kv_heads, T, d) as
    captured (``scaling`` times q @ k is the logit) -> (kv_heads, len(FRACTIONS)) float32, or None
    when no sample has ``MIN_TOKENS`` tokens."""
    fractions = torch.tensor(FRACTIONS, dtype=torch.float64)
    total, queries = None, 0
    for q, k in pairs:
        heads, tokens, _ = q.shape
        kv_heads = k.shape[0]
        if tokens < MIN_TOKENS:
            continue
        positions = torch.linspace(tokens // 2, tokens - 1, QUERIES).round().long().unique()  # (Q,)
        n = positions.numel()
        keys = k.double().repeat_interleave(heads // kv_heads, dim=0)  # (heads, T, d)
        logits = torch.einsum("hqd,htd->hqt", q[:, positions].double() * scaling, keys)
        logits.masked_fill_(torch.arange(tokens)[None, None] > positions[None, :, None], float("-inf"))
        grouped = logits.view(kv_heads, heads // kv_heads, n, tokens)
        mass = grouped.softmax(dim=-1).mean(dim=1)  # (kv_heads, Q, T): the group's mean attention
        order = grouped.amax(dim=1).argsort(dim=-1, descending=True, stable=True)
        kept = mass.gather(-1, order).cumsum(dim=-1)  # (kv_heads, Q, T): mass of the best j + 1 tokens
        counts = ((positions[:, None] + 1) * fractions[None, :]).ceil().long()  # (Q, F), at least 1
        missed = 1 - kept.gather(-1, (counts - 1).expand(kv_heads, n, -1))
        total = missed.sum(dim=1) if total is None else total + missed.sum(dim=1)
        queries += n
    return None if total is None else (total / queries).clamp(0, 1).float()
