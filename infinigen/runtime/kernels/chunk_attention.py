"""A prefill chunk's attention over keys that arrive in blocks: the earlier chunks' KV read a block at a
time (from the CPU pool, or from a dense layer's buffer), then the chunk's own. Each block's attention
gives its output and the log-sum-exp of its logits; outputs merge by those (as in flash attention's
outer loop), so the workspace is one block's, never a whole layer's KV, and never the KV repeated for
every query head of a group.

On CUDA each block runs PyTorch's flash attention kernel where every key of the block is allowed (every
block after a left-padded batch's padding), else its memory-efficient kernel, which takes the block's mask
as an additive bias; both return the log-sum-exp. A block of earlier keys that every query reads takes a KV
head's query group as that many more queries (grouped-query models): only blocks with a mask, and the
chunk's own causal one, repeat their KV for every query head. Elsewhere the same in PyTorch
(``block_attention``): the CPU path, and the tests' reference.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

ALIGN = 16  # the efficient kernel reads its bias in rows of 16-element multiples


Block = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool]  # keys, values, allowed, causal


def block_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor | None,
    scale: float,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """query (B, H, c, d) over one block: keys / values (B, kv_heads, n, d), ``allowed`` (B, 1, c, n) bool
    or None (every key; with ``causal``, query i the keys up to i, n == c). Returns the output (B, H, c, d)
    float32 and the log-sum-exp (B, H, c) float32 (-inf where a query may read no key of the block; its
    output is then 0)."""
    if on_cuda_kernel(query):
        return _efficient(query, keys, values, allowed, scale, causal)
    batch, heads, length, head_dim = query.shape
    kv_heads = keys.shape[1]
    grouped = query.view(batch, kv_heads, heads // kv_heads, length, head_dim).float()
    scores = grouped @ keys[:, :, None].float().transpose(-1, -2) * scale  # (B, kv_heads, G, c, n)
    if causal and allowed is None:
        allowed = torch.ones(length, keys.shape[2], dtype=torch.bool, device=query.device).tril()[None, None]
    if allowed is not None:
        scores = scores.masked_fill(~allowed[:, :, None], -math.inf)
    lse = scores.logsumexp(dim=-1)  # (B, kv_heads, G, c)
    probs = (scores - lse[..., None]).exp().nan_to_num(0.0)
    out = probs @ values[:, :, None].float()
    return out.reshape(batch, heads, length, head_dim), lse.reshape(batch, heads, length)


def on_cuda_kernel(query: torch.Tensor) -> bool:
    return query.device.type == "cuda" and query.dtype in (torch.float16, torch.bfloat16, torch.float32)


def _efficient(query, keys, values, allowed, scale, causal) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, length, head_dim = query.shape
    kv_heads, n = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    if allowed is None and not causal and group > 1:  # every query reads every key: a KV head's query group
        folded = query.reshape(batch, kv_heads, group * length, head_dim)  # folds into its queries, no KV copies
        out, lse = _efficient(folded, keys, values, None, scale, False)
        return out.reshape(batch, heads, length, head_dim), lse.reshape(batch, heads, length)
    keys = keys.repeat_interleave(group, dim=1) if group > 1 else keys  # one block's: bounded
    values = values.repeat_interleave(group, dim=1) if group > 1 else values
    if allowed is None and _flash_suits(query):  # about twice the efficient kernel's speed on an H100 / H200
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            query, keys, values, 0.0, causal, False, scale=scale
        )[:2]
        del keys, values
        return out.float(), lse.float()
    bias = None
    if allowed is not None:  # additive, its rows padded to the kernel's alignment (the padding keys masked)
        padded = -(-n // ALIGN) * ALIGN
        bias = torch.full((batch, 1, length, padded), -math.inf, dtype=query.dtype, device=query.device)
        bias[..., :n].masked_fill_(allowed, 0.0)
        bias = bias[..., :n].expand(batch, heads, length, n)
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, keys, values, bias, True, 0.0, causal and allowed is None, scale=scale
    )[:2]
    del keys, values, bias  # the block's repeated KV and bias go before the float32 output is made
    lse = lse[:, :, :length].float()
    if allowed is not None:  # the kernel's log-sum-exp of a row with no key is not -inf (NaN on an H200)
        lse = lse.masked_fill(~allowed.any(dim=-1), -math.inf)
    return out.float().masked_fill_(~torch.isfinite(lse)[..., None], 0.0), lse  # a query that reads no key: 0


def _flash_suits(query: torch.Tensor) -> bool:
    """Whether PyTorch's flash kernel takes this query: 16-bit, a head size it was built for, an Ampere or
    later GPU, and the backend not switched off (``torch.backends.cuda.enable_flash_sdp``)."""
    head_dim = query.shape[-1]
    return (
        query.dtype in (torch.float16, torch.bfloat16)
        and head_dim % 8 == 0
        and head_dim <= 256
        and torch.backends.cuda.flash_sdp_enabled()
        and torch.cuda.get_device_capability(query.device) >= (8, 0)
    )


def merged_attention(query: torch.Tensor, blocks: Iterable[Block], scale: float) -> torch.Tensor:
    """query (B, H, c, d) over every (keys, values, allowed, causal) block of ``blocks`` (``block_attention``'s),
    merged by log-sum-exp: the output (B, c, H, d) in the query's dtype, as transformers' attention
    functions return it (0 for a query that reads no key)."""
    total = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    lse = torch.full(query.shape[:3], -math.inf, dtype=torch.float32, device=query.device)
    for keys, values, allowed, causal in blocks:
        out, block_lse = block_attention(query, keys, values, allowed, scale, causal)
        merged = torch.logaddexp(lse, block_lse)
        old = (lse - merged).exp().nan_to_num(0.0)  # -inf - -inf: a query with no key yet
        new = (block_lse - merged).exp().nan_to_num(0.0)
        total.mul_(old[..., None]).add_(out.mul_(new[..., None]))  # in place: the workspace stays two outputs
        del out
        lse = merged
    return total.to(query.dtype).transpose(1, 2)
